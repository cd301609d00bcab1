"""The release: one version, read by pyproject and kvspec alike, and ``kvspec --version`` (issue 24, item 7)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvspec
from kvspec import cli
from kvspec._version import __version__

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert not re.search(r"^version\s*=\s*\"", pyproject, re.MULTILINE), "pyproject.toml must not write the version"
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.MULTILINE)
    assert re.search(r'^version = \{ attr = "kvspec\._version\.__version__" \}$', pyproject, re.MULTILINE)
    assert kvspec.__version__ is __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__), __version__
    assert __version__ == "0.2.0"


def test_version_flag_prints_the_package_and_the_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    major, minor = kvspec.PROTOCOL_VERSION
    assert capsys.readouterr().out == f"kvspec {kvspec.__version__} (protocol {major}.{minor})\n"
    assert capsys.readouterr().out == ""
    assert cli.version_line().startswith("kvspec 0.2.0 ")


def test_the_changelog_has_the_release_below_unreleased() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    # Later work lands under "Unreleased"; the release itself is the next heading.
    assert headings[:3] == ["Unreleased", kvspec.__version__, "0.1.0"], headings
