"""Find a backend by built-in name, entry point, or ``module:factory`` path."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import typing
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from types import ModuleType

from kvspec.core._errors import ConfigError
from kvspec.transport._base import Backend

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "import_named_module",
    "is_factory_of",
    "load_backend",
    "parse_backend_options",
]

ENTRY_POINT_GROUP = "kvspec.backends"

# name -> "module:factory"; a factory takes keyword options and returns a Backend.
BUILTIN_BACKENDS: dict[str, str] = {
    "loopback": "kvspec.transport.loopback:LoopbackBackend",
    "torch": "kvspec.transport.torch_dist:TorchDistributedBackend",
    "nixl": "kvspec.transport.nixl:NixlBackend",
    "mooncake": "kvspec.transport.mooncake:MooncakeBackend",
}


def _implicit_working_directory() -> list[str]:
    """The entries of ``sys.path`` that stand for the working directory without the user naming it.

    ``""`` (``python -c``, the REPL) and the working directory itself
    (``python -m``), unless ``PYTHONPATH`` names that directory.
    """
    here = os.path.realpath(os.getcwd())
    named = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return [p for p in sys.path if p in ("", os.curdir) or (os.path.realpath(p) == here and here not in named)]


def import_named_module(module_name: str) -> ModuleType:
    """Import the module of a ``module:name`` path the user gave, with the working directory off ``sys.path``.

    A file that happens to sit in the working directory (a planted
    ``einops.py``) is never imported in place of the module a package
    imports. The user's own module is found as any other: installed, or in a
    directory ``PYTHONPATH`` names (``PYTHONPATH=. kvspec ...`` names the
    working directory on purpose).
    """
    implicit = _implicit_working_directory()
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in implicit]
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path[:] = saved + [p for p in sys.path if p not in saved]  # what the import added (.pth) stays


def _resolve(path: str) -> Callable[..., Backend]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"backend: expected a built-in name or 'module:factory', got {path!r}")
    module = import_named_module(module_name)
    try:
        factory: Callable[..., Backend] = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"backend: module {module_name!r} has no attribute {attr!r}") from None
    if not _is_backend_factory(factory):
        # Never call an arbitrary callable (os:system) on the strength of a command-line string.
        raise ConfigError(
            f"backend: {path!r} is not a backend factory: expected a class with create_agent and close, "
            "or a function annotated to return a Backend"
        )
    return factory


def is_factory_of(obj: object, kind: type, hooks: Sequence[str]) -> bool:
    """Whether ``obj`` may be called to make a ``kind``, judged without calling it.

    True for a class with every method in ``hooks``, or for a function whose return
    annotation is ``kind`` or such a class. A command line names factories
    (``module:factory``); nothing else it names is ever called (``os:system``).
    """

    def has_hooks(candidate: object) -> bool:
        return isinstance(candidate, type) and all(callable(getattr(candidate, name, None)) for name in hooks)

    if isinstance(obj, type):
        return has_hooks(obj)
    if not inspect.isfunction(obj):
        return False
    try:
        returned = typing.get_type_hints(obj).get("return")
    except Exception:  # an annotation that does not resolve says nothing trustworthy
        return False
    return returned is kind or has_hooks(returned)


def _is_backend_factory(obj: object) -> bool:
    """A Backend class, or a function whose return annotation is Backend or a Backend class."""
    return is_factory_of(obj, Backend, ("create_agent", "close"))


def _check_options(spec: str, factory: Callable[..., Backend], options: dict[str, object]) -> None:
    """Refuse an ``--option`` key the factory does not take, naming the keys it does."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no signature to check against: the call itself decides
    try:
        signature.bind(**options)
    except TypeError:
        takes = [p.name for p in signature.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        unknown = sorted(set(options) - set(takes))
        raise ConfigError(
            f"backend {spec!r}: --option {', '.join(unknown) or sorted(options)}: expected one of {takes}"
        ) from None


def load_backend(spec: str = "loopback", **options: object) -> Backend:
    """Build a backend from ``"loopback"``, ``"torch"``, ``"nixl"``, ``"mooncake"``, an entry-point
    name in the ``kvspec.backends`` group, or ``"package.module:factory"``.

    Raises :class:`kvspec.BackendUnavailableError` (an ``ImportError``) when the
    backend's optional dependency is missing, with the install command.
    """
    if spec in BUILTIN_BACKENDS:
        factory = _resolve(BUILTIN_BACKENDS[spec])
    elif ":" in spec:
        factory = _resolve(spec)
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            known = sorted(BUILTIN_BACKENDS) + sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            raise ConfigError(f"backend: expected one of {known} or 'module:factory', got {spec!r}")
        factory = found[0].load()
    _check_options(spec, factory, options)
    backend = factory(**options)
    if not isinstance(backend, Backend):
        raise ConfigError(f"backend: factory for {spec!r} returned {type(backend).__name__}, not a Backend")
    return backend


def _convert(value: str) -> object:
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_backend_options(values: Sequence[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings (the CLIs' ``--option``) as :func:`load_backend` keywords, int/float/bool converted.

    >>> parse_backend_options(["tls=tcp", "max_idle_workers=0", "in_process=false"])
    {'tls': 'tcp', 'max_idle_workers': 0, 'in_process': False}
    """
    options: dict[str, object] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option: expected KEY=VALUE, got {item!r}")
        options[key.strip()] = _convert(value.strip())
    return options
