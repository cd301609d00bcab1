"""Expected-failure lists: the public parser, and the lists kvspec ships for vLLM's connectors, by name.

A list is ``KEY=REASON`` lines; blank lines and ``#`` comments are skipped.
For ``kvspec conform`` a key is a case id (``CLIP-1/sw-tail-keeps-last-n``);
for ``kvspec vllm-audit`` it is a deviation class, ``CONNECTOR/CLASS`` or just
``CLASS`` for every connector audited. A listed key that no longer fails is
itself a failure: the deviation is gone, the line must go too (FAIL-1).
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from kvspec.core._errors import ConfigError
from kvspec.integrations._vllm_versions import expected_file_stem

__all__ = ["expected_names", "load_expected", "parse_expected", "read_expected"]

_PACKAGE = "kvspec.integrations"
_FOLDER = "expected"


def parse_expected(lines: Iterable[str], *, what: str = "expected failure") -> dict[str, str]:
    """``KEY=REASON`` lines as a dict, in order; :class:`ConfigError` naming the line for one without a reason."""
    expected: dict[str, str] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, reason = line.partition("=")
        key, reason = key.strip(), reason.strip()
        if not sep or not key or not reason:
            raise ConfigError(f"{what} line {number}: expected KEY=REASON, got {line!r}")
        expected[key] = reason
    return expected


def expected_names() -> list[str]:
    """The names :func:`load_expected` knows: ``vllm:nixl``, ..., ``vllm-audit``, ``sglang:mori``, ``sglang-audit``.

    A vLLM list also has a name per verified release after 0.33
    (``vllm:nixl-0.34``, ``vllm-audit-0.34``); the plain name picks the
    installed release's list (:func:`expected_file_stem`).
    """
    folder = resources.files(_PACKAGE).joinpath(_FOLDER)
    names = []
    for entry in sorted(e.name for e in folder.iterdir() if e.name.endswith(".txt")):
        stem = entry.removesuffix(".txt")
        prefix, _, rest = stem.partition("-")
        audit = rest == "audit" or rest.startswith("audit-")
        names.append(f"{prefix}:{rest}" if prefix in ("vllm", "sglang") and not audit else stem)
    return names


def _file_name(name: str) -> str:
    stem = name.replace(":", "-", 1)
    if stem.startswith("vllm-") and stem.rpartition("-")[2].count(".") != 1:
        # A plain vLLM name: the installed release's list, where it has one of its own.
        release_stem = expected_file_stem(stem)
        if resources.files(_PACKAGE).joinpath(_FOLDER, release_stem + ".txt").is_file():
            return release_stem + ".txt"
    return stem + ".txt"


def read_expected(name_or_path: str) -> list[str]:
    """The lines of a shipped list (``vllm:nixl``, ``vllm-audit``) or of a file; :class:`ConfigError` if neither."""
    path = Path(name_or_path)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"expected-failure file {name_or_path}: {exc}") from exc
    if name_or_path in expected_names():
        # A plain vLLM name (``vllm:nixl``) reads the installed vLLM release's list.
        shipped = resources.files(_PACKAGE).joinpath(_FOLDER, _file_name(name_or_path))
        return shipped.read_text(encoding="utf-8").splitlines()
    raise ConfigError(f"expected-failure list {name_or_path!r}: expected a file or one of {expected_names()}")


def load_expected(name_or_path: str) -> dict[str, str]:
    """A shipped list by name (``load_expected("vllm:nixl")``) or a file, parsed by :func:`parse_expected`."""
    return parse_expected(read_expected(name_or_path), what=name_or_path)
