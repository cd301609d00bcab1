#!/usr/bin/env python3
"""Move kvspec's flat private modules into their layers' packages and rewrite every reference to them.

kvspec's layers (docs/explanation/layers.md, tests/test_layers.py) were a flat
package of ``_x.py`` modules beside the public faces. This script gives each
layer a package, once, on the merged tree (decisions 151-153):

- ``git mv`` of each flat private module into its package (``kvspec/_plan.py``
  becomes ``kvspec/protocol/_plan.py``); module names do not change, and the
  public faces (``kvspec``, ``kvspec.exchange``, ``kvspec.cli``, ...) stay put;
- every reference rewritten in kvspec/, conformance/, tests/, benchmarks/,
  docs/, scripts/, README.md, pyproject.toml and mkdocs.yml: dotted names
  (imports, ``mock.patch`` strings), paths (``kvspec/_plan.py``),
  ``from kvspec import _plan`` and relative imports;
- the LAYERS table of tests/test_layers.py given the new packages, the table of
  docs/explanation/layers.md regenerated (package, modules, line counts), a
  docs hook that recounts the lines at every build and a test that keeps the
  page and LAYERS in step;
- the new packages listed in pyproject.toml, the moves listed in RENAMES.md.

It is idempotent: run again, it finds nothing to move and rewrites only
references that a later merge brought back. A flat private module it has no
rule for stops it before anything changes; add the module to ``MOVES``.

Usage, from the repository root::

    python scripts/relayout.py --check   # print the plan, change nothing
    python scripts/relayout.py           # do it, then ruff-sort and format the Python files it changed
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Flat private module -> the package of its layer. One line per module; a module not here stops the script.
MOVES: dict[str, str] = {
    # base, errors, data
    "_enums": "core",
    "_deprecation": "core",
    "_errors": "core",
    "_models": "core",
    "_descriptors": "core",
    "_rules": "core",
    # the reference layer (was "rules")
    "_reference": "reference",
    "_offload": "reference",
    "_messages": "reference",
    "_integrity": "reference",
    "_presets": "reference",
    # protocol, reports
    "_plan": "protocol",
    "_codec": "protocol",
    "_handshake": "protocol",
    "_session": "protocol",
    "_offload_session": "protocol",
    "_schema": "protocol",
    "_summary": "protocol",
    # drivers
    "_connector": "drivers",
    "_driver": "drivers",
    "_exchange": "drivers",
    "_engine": "drivers",
    # tools
    "_vectors": "tools",
    "_vector_cases": "tools",
    "_vectors_check": "tools",
}
# Private modules that stay at the top on purpose: packaging reads the version there (pyproject.toml).
STAYS = frozenset({"_version"})

# The new packages: their docstrings say what they hold (every kvspec module opens with one line).
PACKAGES: dict[str, str] = {
    "core": "The core layers: enums, deprecation aliases, errors, KV-cache models, descriptors, the rule registry.",
    "reference": "The reference layer: the reference functions of the rules, messages, page digests, model presets.",
    "protocol": "The protocol layers: the planner, the codec, the handshake, the sans-IO sessions; schemas, summaries.",
    "drivers": "The drivers layer: the connector seams, the driver core and the exchange endpoints.",
    "tools": "The tools layer's private modules: the test vectors (written, answered, checked).",
}
PACKAGE_NOTE = (
    "Private modules only (docs/explanation/layers.md): import their public names from :mod:`kvspec` or\n"
    "the public submodule that re-exports them.\n"
)

# Layers renamed with the packages: "rules" is the reference package; "spec" (the public faces) clashed
# with kvspec.spec, the definitions.
LAYER_RENAMES: dict[str, str] = {"rules": "reference", "spec": "api"}

# Where references are rewritten (CHANGELOG.md and RENAMES.md keep their history).
SCOPE_DIRS = ("kvspec", "conformance", "tests", "benchmarks", "docs", "scripts")
SCOPE_FILES = ("README.md", "pyproject.toml", "mkdocs.yml")
TEXT_SUFFIXES = frozenset({".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json", ""})
SELF = Path("scripts/relayout.py")

LAYERS_TEST = Path("tests/test_layers.py")
LAYERS_PAGE = Path("docs/explanation/layers.md")
LAYERS_HOOK = Path("docs/_gen/layers.py")
PYPROJECT = Path("pyproject.toml")
MKDOCS = Path("mkdocs.yml")
RENAMES = Path("RENAMES.md")


class RelayoutError(Exception):
    """The tree is not in a state this script knows how to change; nothing was written."""


@dataclass
class Plan:
    """What one run changes: moves, then file contents (by path after the moves)."""

    moves: list[tuple[Path, Path]] = field(default_factory=list)
    writes: dict[Path, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- the tree


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RelayoutError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def old_name(module: str) -> str:
    return f"kvspec.{module}"


def new_name(module: str) -> str:
    return f"kvspec.{MOVES[module]}.{module}"


def flat_private_modules() -> list[str]:
    """Private modules at kvspec's top level, other than the ones that stay there."""
    return sorted(
        p.stem
        for p in (ROOT / "kvspec").glob("_*.py")
        if p.stem not in ("__init__", "__main__") and p.stem not in STAYS
    )


def check_tree() -> None:
    """Stop before anything changes when a flat module has no rule or a package name is taken."""
    unknown = [m for m in flat_private_modules() if m not in MOVES]
    if unknown:
        lines = "\n".join(f'    "{m}": "<package>",' for m in unknown)
        raise RelayoutError(
            f"kvspec has flat private modules this script has no rule for: {', '.join(unknown)}.\n"
            f"Add one line each to MOVES in {SELF} (packages: {', '.join(sorted(set(MOVES.values())))}):\n{lines}"
        )
    for package in sorted(set(MOVES.values())):
        if (ROOT / "kvspec" / f"{package}.py").exists():
            raise RelayoutError(f"kvspec/{package}.py exists: the package kvspec/{package}/ cannot be made beside it")
    both = [m for m in MOVES if (ROOT / "kvspec" / f"{m}.py").exists() and _moved_path(m).exists()]
    if both:
        raise RelayoutError(f"modules both flat and moved (resolve by hand): {both}")


def _moved_path(module: str) -> Path:
    return ROOT / "kvspec" / MOVES[module] / f"{module}.py"


def planned_moves() -> list[tuple[Path, Path]]:
    return [
        (Path("kvspec") / f"{m}.py", Path("kvspec") / MOVES[m] / f"{m}.py")
        for m in MOVES
        if (ROOT / "kvspec" / f"{m}.py").exists()
    ]


def scope_files() -> list[Path]:
    """Tracked text files whose references are rewritten, by their path before the moves."""
    listed = _git("ls-files", "-z", "--", *SCOPE_DIRS, *SCOPE_FILES).split("\0")
    return sorted(
        Path(name)
        for name in listed
        if name and Path(name) != SELF and Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()
    )


# --------------------------------------------------------------------------- rewriting references

_NAMES = "|".join(sorted(MOVES, key=len, reverse=True))
DOTTED = re.compile(rf"(?<![\w.])kvspec\.({_NAMES})\b")
PATH = re.compile(rf"(?<![\w.-])kvspec/({_NAMES})(?=\.py\b)")


# Lines the rewrite makes too long (E501), shortened: exact text, replaced wherever it occurs.
FIXUPS: dict[str, str] = {
    (
        "The driver core (kvspec.drivers._driver): actions carried out in table order, "
        "transfers polled first, typed faults."
    ): "The driver core (kvspec.drivers._driver): actions done in table order, transfers polled first, typed faults.",
}


def rewrite_text(text: str) -> str:
    """``kvspec._plan`` -> ``kvspec.protocol._plan`` and ``kvspec/_plan.py`` -> ``kvspec/protocol/_plan.py``."""
    text = DOTTED.sub(lambda m: new_name(m[1]), text)
    text = PATH.sub(lambda m: f"kvspec/{MOVES[m[1]]}/{m[1]}", text)
    for old, new in FIXUPS.items():
        text = text.replace(old, new)
    return text


def import_attribute_modules(text: str) -> str:
    """``import kvspec.reference._reference`` where code reaches it as ``kvspec.reference._reference.f``.

    A flat ``kvspec._reference`` was an attribute of ``kvspec`` for the type checker because
    ``kvspec/__init__.py`` imports from it; a module one package deeper is not, so the file imports it.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    moved = {new_name(m) for m in MOVES}
    reached: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = [node.attr]
            base = node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "kvspec":
                dotted = ".".join(["kvspec", *reversed(chain)])
                reached |= {m for m in moved if dotted == m or dotted.startswith(m + ".")}
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names if not a.asname}
    missing = sorted(reached - imported)
    plain = [n for n in tree.body if isinstance(n, ast.Import)]
    anchor = next((n for n in plain if any(a.name == "kvspec" and not a.asname for a in n.names)), None)
    if not missing or anchor is None or anchor.end_lineno is None:
        return text
    lines = text.splitlines(keepends=True)
    lines[anchor.end_lineno : anchor.end_lineno] = [f"import {m}\n" for m in missing]
    return "".join(lines)


def _module_of(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class _Positions:
    """Turns ast's (line, UTF-8 byte column) positions into offsets in the text."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1] if lineno <= len(self.lines) else ""
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    def span(self, node: ast.expr | ast.stmt) -> tuple[int, int]:
        assert node.end_lineno is not None
        assert node.end_col_offset is not None
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)


def _apply_edits(text: str, edits: Iterable[tuple[int, int, str]]) -> str:
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _alias(name: str, asname: str | None) -> str:
    return f"{name} as {asname}" if asname else name


def rewrite_imports(text: str, old_path: Path, moved_file: bool) -> str:
    """Rewrite the imports a text rewrite cannot: ``from kvspec import _plan`` and relative imports.

    ``from kvspec import _plan`` becomes ``import kvspec.protocol._plan as _plan`` (the import names the
    module itself, which tests/test_layers.py reads); a relative import that reaches a moved module, or
    sits in a moved file, becomes absolute.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError as error:
        raise RelayoutError(f"{old_path}: cannot parse ({error})") from error
    module = _module_of(old_path)
    package = module if old_path.name == "__init__.py" else module.rpartition(".")[0]
    in_kvspec = old_path.parts[0] == "kvspec"
    positions = _Positions(text)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            target = ".".join([*parts, node.module] if node.module else parts)
        else:
            target = node.module or ""
        short = target.removeprefix("kvspec.")
        moved = [a for a in node.names if target == "kvspec" and a.name in MOVES]
        relative_fix = node.level > 0 and in_kvspec and (moved_file or short in MOVES or bool(moved))
        if not moved and not relative_fix:
            continue
        head = new_name(short) if short in MOVES else target
        kept = [a for a in node.names if a not in moved]
        lines = [f"from {head} import {', '.join(_alias(a.name, a.asname) for a in kept)}"] if kept else []
        lines += [f"import {new_name(a.name)} as {a.asname or a.name}" for a in moved]
        start, end = positions.span(node)
        edits.append((start, end, ("\n" + " " * node.col_offset).join(lines)))
    return _apply_edits(text, edits)


# --------------------------------------------------------------------------- tests/test_layers.py

_LAYERS_ASSIGN = "LAYERS"


def _layers_node(tree: ast.Module) -> ast.Tuple:
    for node in tree.body:
        target: ast.expr
        value: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == _LAYERS_ASSIGN and isinstance(value, ast.Tuple):
            return value
    raise RelayoutError(f"{LAYERS_TEST}: no `LAYERS = (...)` tuple found; update the table by hand")


def _layer_sets(layers: ast.Tuple) -> list[tuple[ast.Constant, ast.Set]]:
    """Each (name, frozenset({...})) entry of LAYERS: the name's node and the set's node."""
    found = []
    for item in layers.elts:
        name = item.elts[0] if isinstance(item, ast.Tuple) and len(item.elts) == 2 else None
        members = item.elts[1] if isinstance(item, ast.Tuple) and len(item.elts) == 2 else None
        if not (
            isinstance(name, ast.Constant)
            and isinstance(name.value, str)
            and isinstance(members, ast.Call)
            and isinstance(members.func, ast.Name)
            and members.func.id == "frozenset"
            and len(members.args) == 1
            and isinstance(members.args[0], ast.Set)
        ):
            raise RelayoutError(f"{LAYERS_TEST}: LAYERS entries must read (name, frozenset({{...}})); update by hand")
        found.append((name, members.args[0]))
    return found


def read_layers(text: str) -> list[tuple[str, list[str]]]:
    """LAYERS of tests/test_layers.py, bottom to top: (layer, modules)."""
    layers = _layer_sets(_layers_node(ast.parse(text)))
    out = []
    for name, members in layers:
        modules = [e.value for e in members.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        out.append((str(name.value), modules))
    return out


def rewrite_layers_test(text: str) -> str:
    """Rename layers, put each new package in the lowest layer of its modules, add the page checks."""
    tree = ast.parse(text)
    positions = _Positions(text)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in LAYER_RENAMES:
            start, end = positions.span(node)
            edits.append((start, end, f'"{LAYER_RENAMES[node.value]}"'))
    layers = _layer_sets(_layers_node(tree))
    present = {e.value for _, members in layers for e in members.elts if isinstance(e, ast.Constant)}
    for package in dict.fromkeys(MOVES.values()):
        dotted = f"kvspec.{package}"
        holders = [
            members
            for _, members in layers
            if any(isinstance(e, ast.Constant) and str(e.value).startswith(dotted + ".") for e in members.elts)
        ]
        if dotted in present or not holders:
            continue
        # The lowest layer that holds one of its modules: importing any of them loads the package first.
        offset = positions.span(holders[0].elts[0])[0]
        edits.append((offset, offset, f'"{dotted}", '))
    text = _apply_edits(text, edits)
    if "def test_the_layers_page_lists_every_module_in_its_layer" not in text:
        # The page checks and the docs hook were added by the run that made the layout (commit b37d726); the
        # script no longer carries copies of them, which would drift from the committed files.
        raise SystemExit(f"relayout: {LAYERS_TEST} lacks the layers-page tests of the first run; restore them from git")
    return text


# --------------------------------------------------------------------------- docs/explanation/layers.md

PAGE_HEADER = "| layer | package | modules | lines | what it holds |"
PAGE_INTRO = (
    "Each layer is a package (the private `_x.py` modules sit in their layer's package; the public faces,\n"
    "`kvspec`, `kvspec.connector`, `kvspec.exchange`, `kvspec.testing`, `kvspec.cli` and the others, stay\n"
    "where they were, and `kvspec/_version.py` stays at the top, where packaging reads it). Modules are\n"
    "named below `kvspec.`; the line counts are counted from the sources when the site is built\n"
    "(`docs/_gen/layers.py`)."
)
PAGE_CHECK_OLD = "A new module must be added to both the table in the test and this page."
PAGE_CHECK_NEW = (
    "A new module must be added to both the table in\n"
    "the test and this page; the test checks that they agree, and that no private\n"
    "module is left at kvspec's top level."
)


def _row_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table_span(lines: list[str]) -> tuple[int, int]:
    start = next((i for i, line in enumerate(lines) if _row_cells(line)[:1] == ["layer"]), None)
    if start is None:
        raise RelayoutError(f"{LAYERS_PAGE}: no table with a first column `layer`")
    end = start + 1
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    return start, end


def _module_file(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    if path.is_dir():
        return path / "__init__.py"
    if path.with_suffix(".py").exists():
        return path.with_suffix(".py")
    # --check: a module not moved yet is still flat.
    flat = ROOT / "kvspec" / f"{module.rpartition('.')[2]}.py"
    if module.rpartition(".")[2] in MOVES and flat.exists():
        return flat
    raise RelayoutError(f"{module}: no source file (LAYERS names a module that does not exist)")


def _lines(module: str) -> int:
    short = module.removeprefix("kvspec.")
    if short in PACKAGES and not (ROOT / "kvspec" / short).is_dir():
        return len(_package_init(short).splitlines())  # --check: the package this run creates
    return len(_module_file(module).read_text(encoding="utf-8").splitlines())


def _package_of(module: str) -> str:
    if module == "kvspec" or (ROOT.joinpath(*module.split(".")).is_dir()):
        return module
    if module.removeprefix("kvspec.") in MOVES.values():
        return module
    return module.rpartition(".")[0]


def _short(module: str) -> str:
    return "kvspec" if module == "kvspec" else module.removeprefix("kvspec.")


def render_layers_page(text: str, layers: Sequence[tuple[str, list[str]]]) -> str:
    """The page with its table regenerated from LAYERS: layer, package, modules, lines, what it holds."""
    lines = text.splitlines()
    start, end = _table_span(lines)
    held: dict[str, str] = {}
    for line in lines[start + 2 : end]:
        cells = _row_cells(line)
        name = cells[0]
        held[LAYER_RENAMES.get(name, name)] = cells[-1] if len(cells) < 5 else "|".join(cells[4:])
    missing = [name for name, _ in layers if name not in held]
    if missing:
        raise RelayoutError(
            f"{LAYERS_PAGE}: add a row for each of these layers of LAYERS (say what it holds): {missing}"
        )
    table = [PAGE_HEADER, "|---|---|---|---:|---|"]
    for name, modules in layers:
        packages: dict[str, int] = {}
        for module in modules:
            packages[_package_of(module)] = packages.get(_package_of(module), 0) + 1
        by_size = sorted(packages, key=lambda p: (-packages[p], p))
        package_cell = ", ".join(f"`{p}`" for p in by_size)
        # The layer's main package first, each package itself before its modules.
        ordered = sorted(modules, key=lambda m: (by_size.index(_package_of(m)), _package_of(m) != m, m))
        module_cell = ", ".join(f"`{_short(m)}`" for m in ordered)
        count = sum(_lines(m) for m in modules)
        table.append(f"| {name} | {package_cell} | {module_cell} | {count} | {held[name]} |")
    out = [*lines[:start], *table, *lines[end:]]
    page = "\n".join(out) + "\n"
    if PAGE_INTRO not in page:
        first_table_line = "\n".join(table[:1])
        page = page.replace(first_table_line, PAGE_INTRO + "\n\n" + first_table_line, 1)
    # The sentence may be wrapped anywhere in the page.
    return re.sub(r"\s+".join(map(re.escape, PAGE_CHECK_OLD.split())), PAGE_CHECK_NEW, page)


# --------------------------------------------------------------------------- pyproject.toml, mkdocs.yml, RENAMES.md


def rewrite_pyproject(text: str) -> str:
    """List every new package in ``[tool.setuptools] packages``."""
    match = re.search(r"^packages = \[\n(?P<body>(?:[ \t]+[^\n]*\n)*?)\]", text, flags=re.M)
    if match is None:
        raise RelayoutError(f"{PYPROJECT}: no `packages = [` list under [tool.setuptools]; add the packages by hand")
    body = match["body"]
    listed = re.findall(r'"([\w.]+)"', body)
    missing = [f"kvspec.{p}" for p in dict.fromkeys(MOVES.values()) if f"kvspec.{p}" not in listed]
    if not missing:
        return text
    entries = body.splitlines(keepends=True)
    last = max(i for i, line in enumerate(entries) if re.search(r'"kvspec(\.[\w.]+)?"', line))
    indent = re.match(r"[ \t]*", entries[last])[0]  # type: ignore[index]
    entries[last + 1 : last + 1] = [f'{indent}"{name}",\n' for name in missing]
    return text[: match.start("body")] + "".join(entries) + text[match.end("body") :]


def rewrite_mkdocs(text: str) -> str:
    """Register the layers hook after the existing hooks."""
    hook = f"  - {LAYERS_HOOK.as_posix()}"
    if hook in text.splitlines():
        return text
    match = re.search(r"^hooks:\n((?:  - [^\n]*\n)+)", text, flags=re.M)
    if match is None:
        raise RelayoutError(f"{MKDOCS}: no `hooks:` list; add `{hook.strip()}` by hand")
    return text[: match.end(1)] + hook + "\n" + text[match.end(1) :]


RENAMES_HEADING = "## Private modules moved into their layers' packages"


def rewrite_renames(text: str) -> str:
    """A section listing the moves (private paths: no alias is kept), replaced on every run."""
    rows = "\n".join(f"| `{old_name(m)}` | `{new_name(m)}` |" for m in sorted(MOVES))
    section = (
        f"{RENAMES_HEADING}\n\n"
        "Each layer became a package (docs/explanation/layers.md). The modules kept their names; the\n"
        "public names they define are imported from where they always were (`kvspec`, `kvspec.exchange`,\n"
        "...). These paths were private, so no alias is kept.\n\n"
        f"| before | after |\n|---|---|\n{rows}\n"
    )
    if RENAMES_HEADING in text:
        head, _, rest = text.partition(RENAMES_HEADING)
        tail = rest[rest.index("\n## ") + 1 :] if "\n## " in rest else ""
        return head + section + ("\n" + tail if tail else "")
    return text.rstrip("\n") + "\n\n" + section


# --------------------------------------------------------------------------- the plan


def _package_init(package: str) -> str:
    return f'"""{PACKAGES[package]}\n\n{PACKAGE_NOTE}"""\n\n__all__: list[str] = []\n'


def make_plan() -> Plan:
    """Everything a run would do, computed without changing a file."""
    check_tree()
    plan = Plan(moves=planned_moves())
    moved_to = {old: new for old, new in plan.moves}
    for package in dict.fromkeys(MOVES.values()):
        init = Path("kvspec") / package / "__init__.py"
        if not (ROOT / init).exists():
            plan.writes[init] = _package_init(package)
    for old in scope_files():
        new = moved_to.get(old, old)
        text = (ROOT / old).read_text(encoding="utf-8")
        updated = text
        if old.suffix == ".py":
            updated = rewrite_imports(updated, old, moved_file=old in moved_to)
        updated = rewrite_text(updated)
        if old.suffix == ".py":
            updated = import_attribute_modules(updated)
        if new == LAYERS_TEST:
            updated = rewrite_layers_test(updated)
        if updated != text or old != new:
            plan.writes[new] = updated
    test_text = plan.writes.get(LAYERS_TEST) or (ROOT / LAYERS_TEST).read_text(encoding="utf-8")
    page_old = plan.writes.get(LAYERS_PAGE) or (ROOT / LAYERS_PAGE).read_text(encoding="utf-8")
    page_new = render_layers_page(page_old, read_layers(test_text))
    if page_new != (ROOT / LAYERS_PAGE).read_text(encoding="utf-8"):
        plan.writes[LAYERS_PAGE] = page_new
    if not (ROOT / LAYERS_HOOK).exists():
        raise SystemExit(
            f"relayout: {LAYERS_HOOK} (the docs hook that counts each layer's lines) is missing; restore it"
        )
    for path, rewrite in ((PYPROJECT, rewrite_pyproject), (MKDOCS, rewrite_mkdocs), (RENAMES, rewrite_renames)):
        _rewrite_into(plan, path, rewrite)
    return plan


def _rewrite_into(plan: Plan, path: Path, rewrite: Callable[[str], str]) -> None:
    current = plan.writes.get(path) or (ROOT / path).read_text(encoding="utf-8")
    updated = rewrite(current)
    if updated != (ROOT / path).read_text(encoding="utf-8"):
        plan.writes[path] = updated


def _count_changes(path: Path, new: str, moved_from: Path | None) -> str:
    source = ROOT / (moved_from or path)
    if not source.exists():
        return "new"
    if source != ROOT / path and source.read_text(encoding="utf-8") == new:
        return "moved"
    diff = difflib.unified_diff(source.read_text(encoding="utf-8").splitlines(), new.splitlines(), n=0, lineterm="")
    changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    return f"{changed} line(s) changed"


def describe(plan: Plan) -> Iterable[str]:
    if plan.moves:
        yield f"move {len(plan.moves)} module(s):"
        for old, new in plan.moves:
            yield f"  git mv {old} {new}"
    moved_from = {new: old for old, new in plan.moves}
    edited = sorted(plan.writes)
    if edited:
        yield f"write {len(edited)} file(s):"
        for path in edited:
            yield f"  {path}  ({_count_changes(path, plan.writes[path], moved_from.get(path))})"
    if not plan.moves and not plan.writes:
        yield "nothing to do: the layout is already by layer"


def apply(plan: Plan) -> None:
    for old, new in plan.moves:
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        _git("mv", str(old), str(new))
    for path, text in plan.writes.items():
        (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / path).write_text(text, encoding="utf-8")
    tracked = set(_git("ls-files", "-z").split("\0"))
    created = [p.as_posix() for p in plan.writes if p.as_posix() not in tracked]
    if created:
        _git("add", "--", *created)


def recount_page() -> bool:
    """Write the page's table again from the final sources (ruff may have changed their line counts)."""
    text = (ROOT / LAYERS_PAGE).read_text(encoding="utf-8")
    page = render_layers_page(text, read_layers((ROOT / LAYERS_TEST).read_text(encoding="utf-8")))
    if page != text:
        (ROOT / LAYERS_PAGE).write_text(page, encoding="utf-8")
    return page != text


def ruff_findings(paths: Sequence[Path], rename: dict[Path, Path] | None = None) -> Counter[tuple[str, str]] | None:
    """How many findings of each code ruff reports per Python file (by its path after the moves); None without ruff."""
    ruff = shutil.which("ruff")
    files = [p.as_posix() for p in paths if p.suffix == ".py" and (ROOT / p).exists()]
    if ruff is None or not files:
        return None if ruff is None else Counter()
    out = subprocess.run(
        [ruff, "check", "--exit-zero", "--output-format", "concise", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    found: Counter[tuple[str, str]] = Counter()
    for line in out.splitlines():
        match = re.match(r"^(?P<path>[^:]+):\d+:\d+: (?P<code>[A-Z]+\d+)", line)
        if match:
            path = Path(match["path"])
            found[((rename or {}).get(path, path).as_posix(), match["code"])] += 1
    return found


def tidy(paths: Sequence[Path], before: Counter[tuple[str, str]] | None) -> int:
    """Sort the rewritten imports and format the changed Python files with ruff; report what the run added."""
    ruff = shutil.which("ruff")
    files = [p.as_posix() for p in paths if p.suffix == ".py" and (ROOT / p).exists()]
    if ruff is None or before is None:
        print("ruff not found: run `ruff check --select I --fix` and `ruff format` on the changed Python files")
        return 0
    if not files:
        return 0
    subprocess.run([ruff, "check", "--quiet", "--select", "I", "--fix", *files], cwd=ROOT, check=False)
    subprocess.run([ruff, "format", "--quiet", *files], cwd=ROOT, check=False)
    after = ruff_findings(paths) or Counter()
    added = sorted((path, code) for (path, code), n in after.items() if n > before[(path, code)])
    if added:
        print("ruff reports findings this run added (fix by hand, or add a line to FIXUPS):")
        for path, code in added:
            print(f"  {path}: {code}")
        subprocess.run([ruff, "check", "--output-format", "concise", *sorted({p for p, _ in added})], cwd=ROOT)
    return len(added)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="print the plan and change nothing")
    parser.add_argument("--no-ruff", action="store_true", help="do not run ruff on the changed Python files")
    args = parser.parse_args(argv)
    try:
        plan = make_plan()
    except RelayoutError as error:
        print(f"relayout: {error}", file=sys.stderr)
        return 2
    for line in describe(plan):
        print(line)
    if args.check or (not plan.moves and not plan.writes):
        return 0
    before = None if args.no_ruff else ruff_findings([*scope_files()], {old: new for old, new in plan.moves})
    apply(plan)
    left = 0 if args.no_ruff else tidy(sorted(plan.writes), before)
    if recount_page():
        print(f"  {LAYERS_PAGE}: line counts taken again after formatting")
    print("done" if not left else "done, with ruff findings above to fix by hand")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
