"""Engine adapters are ready before any case, under ``kvspec conform`` and under pytest (issue 35, item 4).

An adapter's first use imports its engine (SGLang 27 s cold, vLLM about as
long, and vLLM's offloading scheduler some forty more modules): the suite
calls its ``warm_up()`` first, and pytest's report names what was tested, as
the CLI's does (item 5).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from kvspec_conformance import run_suite

from kvspec import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "how-to" / "own-vllm-connector"

_SUITE = '''
from kvspec_conformance import BackendSuite, ReferenceConnector

from kvspec.transport.loopback import LoopbackBackend


class ColdEngine(ReferenceConnector):
    """An engine adapter whose cases must find it warmed: each of its hooks checks."""

    warmed = False

    def warm_up(self):
        ColdEngine.warmed = True

    def kvspec_tested(self):
        return (("connector", "cold:Engine"), ("engine", "1.2.3"))

    def check_admission(self, config, mode):
        assert ColdEngine.warmed, "a case used the adapter before its warm_up"
        super().check_admission(config, mode)


class TestColdEngine(BackendSuite):
    backend_factory = LoopbackBackend
    connector_factory = ColdEngine
    rules = ("SW-1/per-group-block-size",)
    max_examples = 1
'''


def _properties(element: ET.Element | None) -> dict[str, str]:
    assert element is not None
    return {p.attrib["name"]: p.attrib["value"] for p in element.iter("property")}


def test_backend_suite_warms_the_adapter_and_its_junit_report_names_what_was_tested(tmp_path: Path) -> None:
    """Without the fixture's warm_up the case fails; without the records the report says nothing of the adapter."""
    (tmp_path / "test_cold_engine.py").write_text(textwrap.dedent(_SUITE), encoding="utf-8")
    junit = tmp_path / "junit.xml"
    status = pytest.main(
        ["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), f"--junitxml={junit}", str(tmp_path)]
    )
    sys.modules.pop("test_cold_engine", None)
    assert status == pytest.ExitCode.OK
    root = ET.parse(junit).getroot()
    wanted = {
        "connector": "cold:Engine",
        "engine": "1.2.3",
        "backend": "kvspec.transport.loopback:LoopbackBackend",
        "protocol_version": ".".join(map(str, PROTOCOL_VERSION)),
    }
    suite = _properties(root.find("testsuite/properties"))
    case = _properties(root.find("testsuite/testcase/properties"))
    assert wanted.items() <= suite.items()
    assert wanted.items() <= case.items()  # per case too: pytest-xdist drops a worker's suite properties


# -------------------------------------------------------------------------------------------- the vLLM adapters


@pytest.mark.vllm
@pytest.mark.xdist_group("test_vllm_offload")  # with vLLM's offloading scheduler already imported: about 0.6 s
def test_vllm_adapters_warm_up_asks_for_every_module_their_cases_ask_for(
    vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any case, the adapter's warm-up has asked for every vLLM module a case asks for (none is first there).

    The old offloading adapter imported two modules when built, and adapters
    built without :func:`vllm_connector` none; their first case imported the
    rest (vLLM's first use of its offloading scheduler, about forty more).
    """
    from kvspec.integrations import vllm as integration

    asked: list[str] = []
    import_vllm, import_path = integration.import_vllm, integration.import_path

    def record_module(module: str = "vllm") -> Any:
        asked.append(module)
        return import_vllm(module)

    def record_path(path: str, what: str = "vLLM connector") -> Any:
        asked.append(path)
        return import_path(path, what)

    monkeypatch.setattr(integration, "import_vllm", record_module)
    monkeypatch.setattr(integration, "import_path", record_path)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    # Built as a pytest suite's connector_factory may build them, without vllm_connector's warm-up.
    fork = integration.VllmConnector("my_connector:MyConnector")
    for connector, case in (
        (integration.OffloadingConnector(), "OFF-6/state-slot-restored-at-the-resume-point"),
        (fork, "STATE-2/one-slot-moves"),  # its shape is found among the shipped classes, which that imports
    ):
        asked.clear()
        connector.warm_up()
        warmed = set(asked)
        asked.clear()
        report = run_suite("loopback", rules=[case], connector=connector, max_examples=1)
        assert report.counts()["passed"] == 1, report.render()
        assert sorted(set(asked) - warmed) == []


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_adapters_leave_no_import_to_a_case(vllm: Any) -> None:
    """In a fresh interpreter, adapters built directly and warmed: their cases import no module at all."""
    code = textwrap.dedent(
        """
        import sys
        from kvspec.integrations.vllm import MooncakeConnector, NixlConnector, OffloadingConnector, VllmConnector
        from kvspec_conformance import run_suite

        for connector, rules in (
            (VllmConnector("my_connector:MyConnector"), ["STATE-2/one-slot-moves", "CLIP-1"]),
            (NixlConnector(), ["STATE-2/one-slot-moves", "HMA-1", "CLIP-1"]),
            (MooncakeConnector(), ["STATE-2/one-slot-moves", "CLIP-1"]),
            (OffloadingConnector(), ["OFF-3/two-groups-full-and-window", "OFF-6", "OFF-7"]),
        ):
            connector.warm_up()
            before = set(sys.modules)
            report = run_suite("loopback", rules=rules, connector=connector, max_examples=1)
            assert report.counts()["error"] == 0, report.render()
            late = sorted(m for m in set(sys.modules) - before if not m.startswith("kvspec"))
            print(type(connector).__name__, late)
        """
    )
    path = os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.endswith("]")]
    names = ["VllmConnector", "NixlConnector", "MooncakeConnector", "OffloadingConnector"]
    assert lines == [f"{name} []" for name in names], done.stdout
