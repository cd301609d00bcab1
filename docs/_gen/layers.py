"""MkDocs hook: each layer's line count on docs/explanation/layers.md, counted at every build.

The page's table names each layer's modules below ``kvspec.``; this hook
replaces the ``lines`` cell of each row with the sum of those modules' lines,
so the published counts cannot drift. A module the table names that has no
source stops the build. ``tests/test_layers.py`` checks that the table and its
LAYERS agree.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = "explanation/layers.md"
COLUMNS = ("layer", "package", "modules", "lines", "what it holds")
TOKEN = re.compile(r"`([\w.]+)`")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _rows(markdown: str) -> list[tuple[int, list[str]]]:
    """(line index, cells) of each row of the page's layer table."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if tuple(_cells(line)[:4]) == COLUMNS[:4]), None)
    if start is None:
        raise PluginError(f"{PAGE}: no table with the columns {' | '.join(COLUMNS)}")
    rows = []
    for index in range(start + 2, len(lines)):
        if not lines[index].lstrip().startswith("|"):
            break
        rows.append((index, _cells(lines[index])))
    return rows


def module_file(module: str, root: Path = ROOT) -> Path:
    """The source of a module (a package's ``__init__.py``)."""
    path = root.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _modules(cell: str) -> list[str]:
    """The modules a ``modules`` cell names below ``kvspec.`` (``kvspec`` itself as ``kvspec``), sorted."""
    return sorted("kvspec" if t == "kvspec" else f"kvspec.{t}" for t in TOKEN.findall(cell))


def page_layers(markdown: str) -> dict[str, list[str]]:
    """Each layer of the page's table and its modules, full dotted names, sorted."""
    return {cells[0]: _modules(cells[2]) for _, cells in _rows(markdown)}


def page_line_counts(markdown: str) -> dict[str, int]:
    """Each layer's line count as the page's table states it."""
    return {cells[0]: int(cells[3]) for _, cells in _rows(markdown)}


def with_line_counts(markdown: str, root: Path = ROOT) -> str:
    """The page with every row's ``lines`` cell counted from the sources."""
    lines = markdown.splitlines()
    for index, cells in _rows(markdown):
        total = 0
        for module in _modules(cells[2]):
            path = module_file(module, root)
            if not path.is_file():
                raise PluginError(f"{PAGE}: layer {cells[0]} names {module}, which has no source ({path})")
            total += len(path.read_text(encoding="utf-8").splitlines())
        cells[3] = str(total)
        lines[index] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines) + ("\n" if markdown.endswith("\n") else "")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    return with_line_counts(markdown)
