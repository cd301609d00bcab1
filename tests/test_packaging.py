"""`python -m build` makes a wheel and an sdist that install in a fresh virtualenv, typed, suite included."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run in the fresh environment, from a folder outside the checkout, so nothing resolves to the sources.
CHECK = """
import importlib.metadata, pathlib, sys
import kvspec, kvspec.transport, kvspec_conformance
prefix = pathlib.Path(sys.prefix).resolve()
for module in (kvspec, kvspec_conformance):
    where = pathlib.Path(module.__file__).resolve()
    assert prefix in where.parents, f"{module.__name__} imported from {where}, not from {prefix}"
    assert (where.parent / "py.typed").is_file(), f"{module.__name__} ships no py.typed"
assert kvspec.__version__ == importlib.metadata.version("kvspec"), kvspec.__version__
# The suite works from the installed package: every rule has its cases (the case modules were shipped),
# except rules that wait for suite cases and name the tests that check them meanwhile (OFF-*).
table = kvspec_conformance.catalogue()
waiting = {rule.id for rule in kvspec.RULES if rule.checked_by}
assert table and all(cases for rule, cases in table.items() if rule not in waiting), {
    rule: len(cases) for rule, cases in table.items()
}
# kvspec's CLI finds the suite through this entry point, never by importing it (tests/test_layers.py).
suite = [ep.value for ep in importlib.metadata.entry_points(group="kvspec.suite") if ep.name == "conform"]
assert suite == ["kvspec_conformance.cli"], suite
print("ok", kvspec.__version__)
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the sdist and the wheel once, offline."""
    out = tmp_path_factory.mktemp("dist")
    pytest.importorskip("build")
    built = subprocess.run(
        # No --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist, which
        # also proves the sdist is complete. The backend is this environment's setuptools.
        [sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    # Every folder that ships is declared: an undeclared one costs a newcomer about 40 lines of setuptools
    # warnings on every install.
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr, built.stderr[-2000:]
    return out


def _only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {[p.name for p in found]}"
    return found[0]


def _fresh_venv(where: Path) -> Path:
    """A new virtualenv that sees this environment's packages except kvspec itself.

    Dependencies are linked in rather than downloaded so the test runs offline
    and fast; kvspec can then come only from the artifact under test.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    deps = where / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("kvspec", "__editable__", "_kvspec")) or name.endswith(".pth"):
            continue
        (deps / entry.name).symlink_to(entry)
    python = where / "bin" / "python"
    fresh_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(fresh_site, "deps.pth").write_text(f"{deps}\n", encoding="utf-8")
    return python


def _install_and_check(artifact: Path, venv: Path, *, run_suite: bool = False, cwd: Path | None = None) -> None:
    python = _fresh_venv(venv)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            str(artifact),
        ],
        check=True,
        capture_output=True,
        env=env,
        cwd=venv,
    )
    result = subprocess.run(
        [str(python), "-c", CHECK], check=False, capture_output=True, text=True, env=env, cwd=cwd or venv
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")
    if run_suite:
        # The console script exists and the installed suite runs a rule's cases on loopback.
        command = [str(venv / "bin" / "kvspec"), "conform", "loopback", "--rule", "SW-1", "-q"]
        result = subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=cwd or venv)
        assert result.returncode == 0, result.stdout + result.stderr


def test_wheel_contents(dist: Path) -> None:
    wheel = _only(dist, "kvspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "kvspec/__init__.py",
        "kvspec/py.typed",
        "kvspec/transport/__init__.py",
        "kvspec_conformance/__init__.py",
        "kvspec_conformance/py.typed",
        "kvspec/integrations/expected/vllm-nixl.txt",
        "kvspec/integrations/expected/vllm-audit.txt",
        "kvspec/integrations/constraints/vllm-cpu.txt",
        "kvspec/integrations/constraints/sglang-cpu.txt",
        "kvspec/integrations/expected/sglang-audit.txt",
    ):
        assert required in names, f"{wheel.name} lacks {required}"
    assert not any(n.startswith(("tests/", "docs/", "conformance/")) for n in names), "stray top-level folders"


def test_sdist_contents(dist: Path) -> None:
    sdist = _only(dist, "kvspec-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for required in ("pyproject.toml", "README.md", "src/kvspec/py.typed", "src/kvspec_conformance/__init__.py"):
        assert required in names, f"{sdist.name} lacks {required}"


def test_wheel_installs_in_a_fresh_venv(dist: Path, tmp_path: Path) -> None:
    # Run from a folder that holds a checkout named kvspec, as the own-connector how-to lays one out: the
    # installed package must win over the checkout folder (Python could take the folder for a namespace package).
    work = tmp_path / "work"
    work.mkdir()
    (work / "kvspec").symlink_to(ROOT, target_is_directory=True)
    _install_and_check(_only(dist, "kvspec-*.whl"), tmp_path / "venv", run_suite=True, cwd=work)


@pytest.mark.slow  # the dist fixture builds the wheel from the unpacked sdist, and that wheel is installed above
def test_sdist_installs_in_a_fresh_venv(dist: Path, tmp_path: Path) -> None:
    _install_and_check(_only(dist, "kvspec-*.tar.gz"), tmp_path / "venv")


def test_editable_install_wins_over_a_checkout_folder_named_kvspec(tmp_path: Path) -> None:
    """`pip install -e .` puts src/ on sys.path, so a folder named kvspec in the working directory cannot hide it.

    setuptools' import hook for a package-dir mapping runs after the path search, which took such a folder (a
    checkout named kvspec, as the own-connector how-to lays one out) for an empty namespace package:
    ``module 'kvspec' has no attribute 'presets'``. The editable wheel is built as pip builds it, without pip.
    """
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    out = tmp_path / "editable"
    build = f"from setuptools import build_meta; build_meta.build_editable({str(out)!r})"
    built = subprocess.run([sys.executable, "-c", build], check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    assert "warn" not in (built.stdout + built.stderr).lower(), built.stdout[-2000:] + built.stderr[-2000:]
    site = tmp_path / "site"
    with zipfile.ZipFile(_only(out, "kvspec-*.whl")) as wheel:
        wheel.extractall(site)
    (pth,) = site.glob("*.pth")
    assert pth.read_text(encoding="utf-8").split() == [str(ROOT / "src")], "a path line, not an import hook"
    work = tmp_path / "work"
    work.mkdir()
    (work / "kvspec").symlink_to(ROOT, target_is_directory=True)
    probe = (
        "import site, sys; site.addsitedir(sys.argv[1]); import kvspec, kvspec_conformance; "
        "print(kvspec.presets.__name__, kvspec_conformance.BackendSuite.__name__)"
    )
    found = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, cwd=work, env=env)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split() == ["kvspec.presets", "BackendSuite"]


def test_conform_script_installs_only_when_pyproject_changed(tmp_path: Path) -> None:
    """`scripts/conform` reinstalled kvspec on every run (19 s): now on the first run and after pyproject.toml changes.

    Run on a copy, with a stand-in `.venv/bin/python` and `kvspec` that log their arguments.
    """
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "conform").write_bytes((ROOT / "scripts" / "conform").read_bytes())
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kvspec'\n", encoding="utf-8")
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "kvspec"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n', encoding="utf-8")
        stub.chmod(0o755)

    def installs_after_run() -> int:
        subprocess.run(["bash", str(tmp_path / "scripts" / "conform"), "--rule", "SW-1"], check=True, timeout=60)
        calls = log.read_text(encoding="utf-8").splitlines()
        conform = "kvspec conform loopback --json conformance-report.json --junit conformance-report.xml --rule SW-1"
        assert calls[-1] == conform, calls
        return sum("pip install" in call for call in calls)

    assert installs_after_run() == 1
    assert installs_after_run() == 1, "a second run with nothing changed reinstalled"
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kvspec'\nversion = '9'\n", encoding="utf-8")
    assert installs_after_run() == 2, "a changed pyproject.toml did not reinstall"
