"""Shared test configuration: hypothesis profiles, slow tests, and strict backend requirements."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

# "dev" is quick for the edit loop; "ci" explores more and never times out an
# example on a shared 2-core machine. Choose with --hypothesis-profile=NAME
# (hypothesis' own option) or KVSPEC_HYPOTHESIS_PROFILE; scripts/test uses "ci".
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("KVSPEC_HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked @pytest.mark.slow")
    parser.addoption(
        "--require-backends",
        action="store_true",
        default=False,
        help="fail (instead of skip) tests whose optional backend dependency (torch, nixl) is missing",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--require-backends") and config.getoption("--hypothesis-profile", None) is None:
        # CI runs with --require-backends; use the stricter profile there unless one was chosen.
        settings.load_profile(os.environ.get("KVSPEC_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def _require(config: pytest.Config, module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"{module} is not importable ({exc}); install it with: pip install 'kvspec[{extra}]'"
        if config.getoption("--require-backends"):
            pytest.fail(f"--require-backends: {message}", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def require_module(request: pytest.FixtureRequest) -> Callable[..., ModuleType]:
    """Import an optional dependency: skip the test if missing, but FAIL under --require-backends.

    >>> def test_gloo(require_module):
    ...     torch = require_module("torch")
    """

    def require(module: str, extra: str | None = None) -> ModuleType:
        return _require(request.config, module, extra or module.split(".")[0])

    return require


def require_backend_module(config: pytest.Config, module: str, extra: str | None = None) -> ModuleType:
    """Same as the ``require_module`` fixture, for module-level or class-level use via ``pytestconfig``."""
    return _require(config, module, extra or module.split(".")[0])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the mutation score when the mutant tests ran: "N mutants, N rejected"."""
    mutants = sys.modules.get("mutants")
    score: dict[str, bool] = getattr(mutants, "SCORE", {})
    if score:
        survivors = sorted(name for name, rejected in score.items() if not rejected)
        line = f"{len(score)} mutants, {len(score) - len(survivors)} rejected"
        terminalreporter.write_sep("-", line + (f" (survived: {', '.join(survivors)})" if survivors else ""))


@pytest.fixture(scope="module")
def vllm(pytestconfig: pytest.Config) -> ModuleType:
    """vLLM 0.33.0, the version the vLLM tests pin (skipped or failed as ``--require-backends`` says)."""
    module = require_backend_module(pytestconfig, "vllm", "vllm")
    assert module.__version__ == "0.33.0", f"these tests pin vllm==0.33.0, found {module.__version__}"
    return module
