"""Shared test configuration: hypothesis profiles, slow tests, and strict backend requirements."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

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
    if config.getoption("--run-slow"):
        # Read at collection by suites whose class attributes choose their rules (test_mooncake_backend.py).
        os.environ["KVSPEC_RUN_SLOW"] = "1"
    if config.getoption("--require-backends") and config.getoption("--hypothesis-profile", None) is None:
        # CI runs with --require-backends; use the stricter profile there unless one was chosen.
        settings.load_profile(os.environ.get("KVSPEC_HYPOTHESIS_PROFILE", "ci"))


# Under pytest-xdist (scripts/test runs ``-n 2 --dist loadgroup``) a test that uses a class- or module-scoped
# fixture (a backend's agents, two namespaces) runs on the same worker as the rest of that class or module, so
# the fixture is built once; other tests are spread one by one. Some modules share one unit: those that build
# network namespaces (one at a time, as their lock asks when run by hand) and those that build the checkout
# (setuptools writes build/ and *.egg-info into it). Units start longest first, as measured on the 2-core CI
# machine, so the last ones to finish are short; the rest keep their order.
XDIST_GROUPS = {
    "test_two_hosts": "netns",
    "test_off_loopback": "netns",
    "test_packaging": "builds-the-checkout",
    "test_conformance_cli": "builds-the-checkout",
}
XDIST_LONGEST_FIRST = (
    "netns",
    "test_mooncake_backend",
    "test_vllm_integration",
    "test_nixl_backend",
    "test_conformance_mutants",
    "test_torch_backend",
    "test_vllm_offload",
    "test_conformance_pace",
    "test_vllm_own_connector",
    "builds-the-checkout",
    "test_docs",
)


def _module_name(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def _xdist_group(item: pytest.Item) -> str | None:
    """The work unit an item must share, or None where it can run on any worker."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.kwargs.get("name", mark.args[0] if mark.args else "default"))
    module = _module_name(item)
    if module in XDIST_GROUPS:
        return XDIST_GROUPS[module]
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    scopes = {definition.scope for definitions in fixtures.values() for definition in definitions}
    cls = getattr(item, "cls", None)
    if "class" in scopes and cls is not None and "module" not in scopes:
        return f"{module}::{cls.__name__}"
    if scopes & {"class", "module", "package"}:
        return module
    return None


def _group_by_scope(items: list[pytest.Item]) -> None:
    """Mark each item that shares a fixture with its work unit; move the longest units first (stable otherwise)."""
    rank = {name: i for i, name in enumerate(XDIST_LONGEST_FIRST)}
    last = len(rank)
    order: dict[int, int] = {}
    for item in items:
        group = _xdist_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        order[id(item)] = rank.get(group or "", rank.get(_module_name(item), last))
    items.sort(key=lambda item: order[id(item)])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: pytest-xdist's worker reads the ``xdist_group`` marks in its own hook of this name; the marks must
    # be on the items before it does (test_conformance_conftest.py checks that the groups took).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _group_by_scope(items)
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


def _mutant_score() -> dict[str, bool]:
    mutants = sys.modules.get("mutants")
    return dict(getattr(mutants, "SCORE", {}))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker, hand this worker's mutation score to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["kvspec_mutant_score"] = json.dumps(_mutant_score())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the xdist controller, collect each worker's mutation score."""
    score = json.loads(getattr(node, "workeroutput", {}).get("kvspec_mutant_score", "{}"))
    _WORKER_SCORES.update({str(name): bool(rejected) for name, rejected in score.items()})


_WORKER_SCORES: dict[str, bool] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the mutation score when the mutant tests ran: "N mutants, N rejected"."""
    score = {**_WORKER_SCORES, **_mutant_score()}
    if score:
        survivors = sorted(name for name, rejected in score.items() if not rejected)
        line = f"{len(score)} mutants, {len(score) - len(survivors)} rejected"
        terminalreporter.write_sep("-", line + (f" (survived: {', '.join(survivors)})" if survivors else ""))


@pytest.fixture(scope="session")
def vllm(pytestconfig: pytest.Config) -> ModuleType:
    """vLLM 0.33.0 or 0.34.0, the versions the vLLM tests cover (skipped or failed as ``--require-backends`` says)."""
    from kvspec.integrations.vllm import VERIFIED_VLLM_VERSIONS

    module = require_backend_module(pytestconfig, "vllm", "vllm")
    assert module.__version__ in VERIFIED_VLLM_VERSIONS, (
        f"these tests cover {VERIFIED_VLLM_VERSIONS}, found {module.__version__}"
    )
    return module


@pytest.fixture(scope="session")
def sglang(pytestconfig: pytest.Config) -> ModuleType:
    """kvspec.integrations.sglang with SGLang 0.5.23 importable (skipped, or failed under ``--require-backends``)."""
    from kvspec import BackendUnavailableError
    from kvspec.integrations import sglang as integration

    try:
        integration.check_sglang_version()
        integration.import_sglang("sglang.srt.disaggregation.prefill")
    except BackendUnavailableError as exc:
        message = f"SGLang is not usable ({exc}); install it with: kvspec sglang-setup --print | bash"
        if pytestconfig.getoption("--require-backends"):
            pytest.fail(f"--require-backends: {message}", pytrace=False)
        pytest.skip(message)
    return integration
