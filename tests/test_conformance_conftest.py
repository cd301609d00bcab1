"""The shared conftest's options: --require-backends turns a missing backend dependency into a failure, --run-slow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SAMPLE = """
import pytest
from conftest import require_backend_module


def test_needs_a_missing_backend(pytestconfig):
    require_backend_module(pytestconfig, "kvspec_no_such_backend_module", "nosuch")


def test_fixture_form(require_module):
    require_module("kvspec_no_such_backend_module")


@pytest.mark.slow
def test_slow():
    pass
"""


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(folder), *args],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=300,
    )


def test_missing_backend_skips_by_default_and_fails_when_required(tmp_path: Path) -> None:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n", encoding="utf-8")
    (tmp_path / "test_sample.py").write_text(SAMPLE, encoding="utf-8")
    default = _pytest(tmp_path)
    assert default.returncode == 0, default.stdout
    assert "3 skipped" in default.stdout
    assert "pip install 'kvspec[nosuch]'" in default.stdout
    assert "slow: run with --run-slow" in default.stdout
    required = _pytest(tmp_path, "--require-backends")
    assert required.returncode == 1, required.stdout
    assert "2 failed" in required.stdout
    assert "--require-backends" in required.stdout
    slow = _pytest(tmp_path, "--run-slow", "-k", "slow")
    assert "1 passed" in slow.stdout, slow.stdout


@pytest.fixture(scope="module")
def module_scoped() -> str:
    return "built once per module"


def test_the_test_run_keeps_a_module_with_a_module_fixture_on_one_worker(
    request: pytest.FixtureRequest, module_scoped: str
) -> None:
    """scripts/test's ``--dist loadgroup`` gets the groups tests/conftest.py gives (a pytest that drops them spreads
    each module over both workers, and every module-scoped agent or worker is built twice)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("checks the grouping of scripts/test's run (-n 2 --dist loadgroup)")
    assert request.node.nodeid.endswith("@test_conformance_conftest"), request.node.nodeid
