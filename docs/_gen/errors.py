"""Which public call can raise which kvspec error, found by reading kvspec's source (no import needed)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

__all__ = ["ROOT_ERROR", "public_calls", "raised_by"]

ROOT_ERROR = "KVSpecError"

Key = tuple[str, str]  # (module, qualified name): ("kvspec.reference._reference", "compute_block_pairs")


@attrs.define
class _Node:
    raises: set[str] = attrs.Factory(set)
    calls: set[Key] = attrs.Factory(set)


def _module_name(package_dir: Path, path: Path) -> str:
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(module: str, tree: ast.Module) -> dict[str, Key]:
    """Local name -> (module, name) for ``from kvspec.x import y`` lines."""
    found: dict[str, Key] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import
                base = ".".join(module.split(".")[: -node.level] + ([node.module] if node.module else []))
            for alias in node.names:
                found[alias.asname or alias.name] = (base, alias.name)
    return found


def _error_classes(trees: Mapping[str, ast.Module]) -> dict[str, set[str]]:
    """Every class that derives, directly or not, from the root error -> its error bases."""
    errors: dict[str, set[str]] = {ROOT_ERROR: set()}
    changed = True
    while changed:
        changed = False
        for tree in trees.values():
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name not in errors:
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    if bases & errors.keys():
                        errors[node.name] = bases & errors.keys()
                        changed = True
    return errors


def _is_a(error: str, ancestor: str, bases: Mapping[str, set[str]]) -> bool:
    return error == ancestor or any(_is_a(base, ancestor, bases) for base in bases.get(error, ()))


class _Collector(ast.NodeVisitor):
    """Fills the call graph of one module."""

    def __init__(self, module: str, tree: ast.Module, errors: set[str], graph: dict[Key, _Node]) -> None:
        self.module, self.errors, self.graph = module, errors, graph
        self.imports = _imports(module, tree)
        self.functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        self.error_returning = {
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef)
            and isinstance(n.returns, (ast.Name, ast.Constant))
            and getattr(n.returns, "id", getattr(n.returns, "value", None)) in errors
        }
        self.current: list[str] = []
        self.klass: str | None = None

    def _node(self) -> _Node:
        return self.graph.setdefault((self.module, ".".join(self.current) or "<module>"), _Node())

    def _resolve(self, name: str) -> Key | None:
        if name in self.functions:
            return (self.module, name)
        if name in self.classes:
            return (self.module, f"{name}.__init__")
        if name in self.imports:
            module, attr = self.imports[name]
            return (module, attr)
        return None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = self.klass
        self.klass = node.name
        self.current.append(node.name)
        init = self.graph.setdefault((self.module, f"{node.name}.__init__"), _Node())
        for item in node.body:
            # attrs validators, converters and post-init hooks run on construction.
            for sub in ast.walk(item):
                if isinstance(sub, ast.keyword) and sub.arg in {"validator", "converter"}:
                    for name in ast.walk(sub.value):
                        if isinstance(name, ast.Name) and (key := self._resolve(name.id)):
                            init.calls.add(key)
            if isinstance(item, ast.FunctionDef) and (
                item.name == "__attrs_post_init__"
                or any(
                    isinstance(d, ast.Attribute) and d.attr in {"validator", "converter"} for d in item.decorator_list
                )
            ):
                init.calls.add((self.module, f"{node.name}.{item.name}"))
        for base in node.bases:
            if isinstance(base, ast.Name) and (key := self._resolve(base.id)) and key[1].endswith(".__init__"):
                init.calls.add(key)
        self.generic_visit(node)
        self.current.pop()
        self.klass = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.current.append(node.name)
        self._node()
        self.generic_visit(node)
        self.current.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Raise(self, node: ast.Raise) -> None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", None)
        if name in self.errors:
            self._node().raises.add(name)
        elif name in self.error_returning:
            self._node().calls.add((self.module, name))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        key: Key | None = None
        if isinstance(func, ast.Name):
            key = self._resolve(func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id in {"self", "cls"} and self.klass:
                key = (self.module, f"{self.klass}.{func.attr}")
            elif func.value.id in self.classes:
                key = (self.module, f"{func.value.id}.{func.attr}")
        if key is not None:
            self._node().calls.add(key)
        self.generic_visit(node)


def _graph(package_dirs: Iterable[Path]) -> tuple[dict[Key, _Node], dict[str, set[str]]]:
    trees = {}
    for package_dir in package_dirs:
        for path in sorted(package_dir.rglob("*.py")):
            trees[_module_name(package_dir, path)] = ast.parse(path.read_text(encoding="utf-8"))
    errors = _error_classes(trees)
    graph: dict[Key, _Node] = {}
    for module, tree in trees.items():
        _Collector(module, tree, set(errors), graph).visit(tree)
    return graph, errors


def _closure(graph: Mapping[Key, _Node], key: Key, seen: set[Key]) -> set[str]:
    if key in seen or key not in graph:
        return set()
    seen.add(key)
    node = graph[key]
    found = set(node.raises)
    for callee in node.calls:
        found |= _closure(graph, callee, seen)
    return found


def raised_by(package_dir: Path, public: Mapping[str, Key]) -> dict[str, list[str]]:
    """Error name -> the public calls (``label -> key``) whose code can raise it or a subclass of it.

    A static over-approximation: a call is listed when some path through
    kvspec's own code raises the error; whether a given input takes that path
    is for the docstring to say.
    """
    graph, bases = _graph([package_dir])
    table: dict[str, set[str]] = {error: set() for error in sorted(bases)}
    for label, key in public.items():
        for raised in _closure(graph, key, set()):
            for error in table:
                if _is_a(raised, error, bases):
                    table[error].add(label)
    return {error: sorted(labels) for error, labels in table.items()}


def public_calls(modules: Iterable[str]) -> dict[str, Key]:
    """Label -> source key of every public function, constructor and method the modules export."""
    import importlib
    import inspect

    out: dict[str, Key] = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            label = f"{module_name}.{name}"
            if inspect.isfunction(obj):
                out[f"{label}()"] = (obj.__module__, obj.__qualname__)
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                out[f"{label}(...)"] = (obj.__module__, f"{obj.__qualname__}.__init__")
                for attr in dir(obj):
                    owner = next((k for k in obj.__mro__ if attr in k.__dict__), None)
                    value = None if owner is None or attr.startswith("_") else owner.__dict__[attr]
                    if isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
                        assert owner is not None
                        out[f"{label}.{attr}()"] = (owner.__module__, f"{owner.__qualname__}.{attr}")
    return out
