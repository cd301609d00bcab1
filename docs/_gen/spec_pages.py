"""The spec pages are kvspec/spec's literate rendering: each public definition on exactly one page, under its rule.

The docs build (docs/hooks.py) stops on any line :func:`check_spec_pages` returns, as
the consensus-specs build does when code and prose part ways.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

# The normative pages' markdown source, prose and tables, all files together (bytes, as ``wc -c`` counts).
SPEC_BUDGET = 90_000

RULE_ID = re.compile(r"\b[A-Z]{2,5}-\d+\b")
# The heading that opens a rule's section, as docs/hooks.py reads it: "## CLIP-1 ...", "### Rule `CLIP-1`: ...".
RULE_HEADING = re.compile(r"^(?P<hashes>#{2,4})\s+(?:Rule\s+)?[*`]*(?P<id>[A-Z]{2,5}-\d+)\b")
HEADING = re.compile(r"^(?P<hashes>#{1,6})\s")
FENCE = re.compile(r"^\s*(```|~~~)")
# <!-- kvspec:spec:MODULE.NAME --> renders a definition's source (docs/hooks.py, spec_source_snippets).
DEFINITION_MARKER = re.compile(r"<!--\s*kvspec:spec:(?P<module>\w+)\.(?P<name>\w+)\s*-->")
# A private module named on a page: kvspec.protocol._session, or its file kvspec/protocol/_session.py.
PRIVATE_MODULE = re.compile(r"\bkvspec(?:\.[A-Za-z]\w*)*\._\w+|\bkvspec(?:/[A-Za-z]\w*)*/_\w+\.py\b")


class Definition(NamedTuple):
    """A top-level public definition of kvspec/spec: its module, its name and the rule ids it may sit under."""

    module: str
    name: str
    rules: frozenset[str]  # empty: it belongs to no rule and may sit under any heading

    @property
    def marker(self) -> str:
        return f"<!-- kvspec:spec:{self.module}.{self.name} -->"


# Modules of kvspec/spec that state no rule: their rows are rendered by their own markers
# (<!-- kvspec:pins:RULE --> renders pins.py's table, rule by rule), not as source.
NOT_RULES = frozenset({"pins"})


def _comment_above(lines: Sequence[str], lineno: int) -> list[str]:
    """The comment lines directly above line ``lineno`` (1-based)."""
    index = lineno - 1
    while index > 0 and lines[index - 1].lstrip().startswith("#"):
        index -= 1
    return list(lines[index : lineno - 1])


def _names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("__")]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


class _Source(NamedTuple):
    module: str
    name: str
    text: str  # its docstring; a constant's: the string below it and the comment above it
    source: str  # its lines: decorators or comment above, through its end (a constant's string included)


def _top_level(path: Path) -> tuple[str, list[_Source]]:
    """A module's docstring and its top-level functions, classes and constants, in source order."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for index, node in enumerate(tree.body):
        names = _names(node)
        if not names or node.end_lineno is None:
            continue
        end = node.end_lineno
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            text = ast.get_docstring(node) or ""
        else:
            above = _comment_above(lines, node.lineno)
            first = node.lineno - len(above)
            text = "\n".join(above)
            after = tree.body[index + 1] if index + 1 < len(tree.body) else None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and after.end_lineno:
                text += "\n" + str(after.value.value)
                end = after.end_lineno
        found.extend(_Source(path.stem, name, text, "\n".join(lines[first - 1 : end])) for name in names)
    return ast.get_docstring(tree) or "", found


def definition_sources(package: Path) -> dict[str, str]:
    """``MODULE.NAME`` -> source for every top-level definition of the package, private ones included."""
    return {
        f"{item.module}.{item.name}": item.source
        for path in sorted(package.glob("*.py"))
        for item in _top_level(path)[1]
    }


def find_definitions(package: Path) -> list[Definition]:
    """Every top-level public definition (function, class, constant) of the package's rule modules, in order.

    Its rules are the rule ids its docstring (a constant: the string below it, the
    comment above it) names; where it names none, those its module's docstring names.
    """
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name == "__init__.py" or path.stem in NOT_RULES:
            continue
        docstring, items = _top_level(path)
        module_rules = frozenset(RULE_ID.findall(docstring))
        for item in items:
            if not item.name.startswith("_"):
                own = frozenset(RULE_ID.findall(item.text))
                found.append(Definition(item.module, item.name, own or module_rules))
    return found


def _rendered(text: str) -> list[tuple[int, str, str, str | None]]:
    """(line, module, name, rule id of the section it sits in) for each definition marker on a page."""
    rendered = []
    rule: str | None = None
    rule_level = 0
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if heading := HEADING.match(line):
            level = len(heading["hashes"])
            if opened := RULE_HEADING.match(line):
                rule, rule_level = opened["id"], level
            elif level <= rule_level:
                rule, rule_level = None, 0
        for marker in DEFINITION_MARKER.finditer(line):
            rendered.append((number, marker["module"], marker["name"], rule))
    return rendered


def check_spec_pages(
    pages: Mapping[str, str], definitions: Sequence[Definition], rule_ids: Sequence[str] = ()
) -> list[str]:
    """One line per way the pages (path -> markdown) and the definitions part; empty when they agree.

    Every definition is rendered exactly once, in the section of a rule its docstring
    names; every rule of ``rule_ids`` (the registry, kvspec.core's RULES) has at
    least one definition rendered in its section, so its definition is in
    kvspec/spec; no page names a private module; the pages stay within :data:`SPEC_BUDGET`.
    """
    problems = []
    places: dict[tuple[str, str], list[tuple[str, int, str | None]]] = {}
    defined: set[str] = set()
    known = {(d.module, d.name) for d in definitions}
    for page, text in sorted(pages.items()):
        for number, module, name, rule in _rendered(text):
            places.setdefault((module, name), []).append((page, number, rule))
            if rule is not None and (module, name) in known:
                defined.add(rule)
        for number, line in enumerate(text.splitlines(), start=1):
            for match in PRIVATE_MODULE.finditer(line):
                problems.append(
                    f"{page}:{number}: names the private module {match[0]}; name the public definition instead"
                )
    for definition in definitions:
        qualified = f"kvspec.spec.{definition.module}.{definition.name}"
        rules = ", ".join(sorted(definition.rules)) or "none"
        found = places.get((definition.module, definition.name), [])
        if not found:
            problems.append(
                f"{qualified} is on no spec page: put {definition.marker} under its rule's heading ({rules})"
            )
        elif len(found) > 1:
            where = ", ".join(f"{page}:{number}" for page, number, _ in found)
            problems.append(f"{qualified} is rendered {len(found)} times ({where}); expected exactly once")
        for page, number, rule in found:
            if definition.rules and rule not in definition.rules:
                section = f"the {rule} heading" if rule else "no rule heading"
                problems.append(f"{page}:{number}: {qualified} sits under {section}; its docstring names {rules}")
    for rule_id in rule_ids:
        # A definition may sit only under a rule its docstring names (above), so one rendered here declares this rule.
        if rule_id not in defined:
            problems.append(
                f"{rule_id} has no definition in kvspec/spec: write it there, its docstring naming {rule_id}, "
                f"and put its marker under the {rule_id} heading"
            )
    total = sum(len(text.encode("utf-8")) for text in pages.values())
    if total > SPEC_BUDGET:
        problems.append(f"docs/spec/*.md: {total:,} characters of markdown source, over the budget of {SPEC_BUDGET:,}")
    return problems
