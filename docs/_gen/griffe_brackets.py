"""Griffe extension: escape indexing brackets in docstrings so Markdown does not read them as links."""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["EscapeIndexing"]

# Inline code spans (``x`` or `x`) stay as they are; outside them, a "[" that follows a name,
# a closing bracket or a closing parenthesis is indexing, e.g. producer[g][i], not a link.
_CODE = re.compile(r"(``.+?``|`[^`]+`)")
_INDEX = re.compile(r"(?<=[\w\])])\[([^\[\]\n]*)\]")


def _escape(match: re.Match[str]) -> str:
    inner = match[1]
    before = match.string[match.start() - 1]
    # [title][] and [title][kvspec.Name] are cross-references, not indexing.
    if before == "]" and (not inner or "." in inner):
        return match[0]
    return f"\\[{inner}\\]"


def escape_indexing(text: str) -> str:
    """Escape ``name[i]`` outside code spans as ``name\\[i\\]``."""
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        previous = None
        while previous != parts[i]:
            previous = parts[i]
            parts[i] = _INDEX.sub(_escape, parts[i])
    return "".join(parts)


class EscapeIndexing(griffe.Extension):
    """Rewrite each docstring once, when griffe loads the object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = escape_indexing(obj.docstring.value)
