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


_IMPLICIT = ("", os.curdir)  # "the working directory, wherever it is": python -c, the REPL


def import_named_module(module_name: str) -> ModuleType:
    """Import the module of a ``module:name`` path the user gave, never from an implicit working directory.

    kvspec adds nothing to ``sys.path``, and ``""`` (put there by ``python -c``
    or the REPL) is left out while the module and what it imports load, so a
    file that happens to sit in the working directory (a planted ``einops.py``)
    never stands in for a module a package imports. The user's own module is
    found as any other: installed, or in a directory named on purpose
    (``PYTHONPATH=.`` names the working directory, as an absolute path).
    ``python -m`` puts the working directory itself first (Python's rule;
    ``python -P`` does not): the ``kvspec`` console script does not.
    """
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in _IMPLICIT]
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
