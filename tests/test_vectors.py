"""The language-neutral test vectors: coverage, schema, determinism, the committed sample, and `vectors check`."""

from __future__ import annotations

import base64
import io
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec import ConfigError, KVSpecError
from kvspec.cli import main
from kvspec.rules import RULES
from kvspec.tools._vector_cases import CASE_SETS, build_archive, build_vectors, dumps_json
from kvspec.tools._vectors import FUNCTIONS, PUBLIC_NAMES, answer_schema, answer_vector, vector_schema
from kvspec.tools._vectors_check import validate_json
from kvspec.vectors import check_vectors, write_vectors

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "vectors"
IMPLS = Path(__file__).resolve().parent / "vector_impls"
PYTHON_ANSWER = f"{shlex.quote(sys.executable)} -m kvspec vectors answer"


@pytest.fixture(scope="module")
def vectors_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vectors") / "set"
    write_vectors(folder)
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- what the set covers


def test_every_rule_and_every_function_has_vectors() -> None:
    vectors = build_vectors()
    assert {v["rule"] for v in vectors} == {rule.id for rule in RULES}
    assert {v["function"] for v in vectors} == set(FUNCTIONS)
    # Each registered function is named by its public name, and every name maps to a registry entry.
    assert set(FUNCTIONS) == set(PUBLIC_NAMES.values())


def test_case_names_are_unique_per_rule_and_function() -> None:
    keys = [(v["rule"], v["function"], v["case"]) for v in build_vectors()]
    assert len(keys) == len(set(keys))


def _vector(rule: str, function: str, case: str) -> dict[str, Any]:
    found = [v for v in build_vectors(rule=rule) if v["function"] == function and v["case"] == case]
    assert len(found) == 1, f"no vector {rule}/{function}/{case}"
    return found[0]


def test_coverage_errors_name_the_rule() -> None:
    # The pinned SW-1, CLIP-1, ALIGN-1, NULL-1 and WIN-1 outputs are checked row by row in tests/test_pins.py.
    error = _vector("WIN-1", "check_window_coverage", "pruned_with_too_many_tokens")["error"]
    assert error["class"] == "WindowCoverageError"
    assert error["rule"] == "WIN-1"


def test_errors_name_their_class_and_rule() -> None:
    errors = [v["error"] for v in build_vectors() if "error" in v]
    known = {rule.id for rule in RULES}
    assert errors
    for error in errors:
        assert error["rule"] in known
        assert issubclass(getattr(__import__("kvspec"), error["class"]), KVSpecError)
    differences = _vector("HS-1", "check_compatibility", "block_size_differs")["error"]["differences"]
    assert differences["groups[0].block_size"] == [16, 32]


def test_sessions_record_every_step() -> None:
    vector = _vector("REL-1", "ConsumerSession", "loaded_then_late_signals")
    steps = vector["output"]["steps"]
    actions = [a for s in steps if "output" in s for a in s["output"]["actions"]]
    releases = [a["message"] for a in actions if a["type"] == "send" and a["message"]["type"] == "release"]
    assert [r["outcome"] for r in releases] == ["loaded"]  # exactly one release (REL-1)
    assert [s["state"] for s in steps] == ["loading", "loaded", "loaded", "loaded"]
    # The actions keep the order a driver carries them out in, each tagged with its type: free before the release.
    first = _vector("REL-1", "ConsumerSession", "aborted_before_start")["output"]["steps"][0]["output"]["actions"]
    assert [a["type"] for a in first] == ["free", "send"]
    error_step = _vector("DONE-1", "ConsumerSession", "write_transfer_done_is_local_error")["output"]["steps"][1]
    assert error_step["error"]["class"] == "LocalProtocolError"


def test_plan_vectors_carry_the_byte_copies() -> None:
    plan = _vector("PLAN-1", "plan_transfer", "contiguous_runs_merge")["output"]
    # Two layers of 256-byte pages, blocks 1-3 -> 6-8 in group 0: one merged run of 3 blocks x 2 layers.
    assert plan["copies"][0] == {
        "consumer_offset": 6 * 512,
        "consumer_region": 0,
        "nbytes": 3 * 512,
        "producer_offset": 512,
        "producer_region": 0,
    }
    assert sum(c["nbytes"] for c in plan["copies"]) == sum(
        g["num_pairs"] * g["num_layers"] * g["page_size"] for g in plan["groups"]
    )


def test_offload_pins_from_the_spec() -> None:
    # docs/spec/offload.md: #48959 (W=4096 B=32 f=8 T=98012 needs 129 blocks, not 128).
    load = _vector("OFF-6", "get_load_set", "issue_48959_needs_129_blocks")["output"]
    assert (load["first_block_indices"], load["num_blocks"]) == ([2934], [129])
    # #42945: the count never includes the null sub-blocks; the first window chunk is written in part (OFF-4).
    store = _vector("OFF-3", "get_store_set", "issue_42945_count_without_nulls")["output"]
    assert (store["block_ids"][1], store["num_blocks"][1], store["partial_chunks"]) == (
        [105, 106, 107, 108],
        4,
        [[], [1]],
    )
    # f=3, first index 4: skip 4 % 3 = 1, never -4 % 3 = 2 (OFF-7).
    assert _vector("OFF-7", "map_sub_blocks", "f3_first_4")["output"] == [[0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert _vector("OFF-4", "get_offload_hit_tokens", "partial_chunk_is_not_present")["output"] == 0
    assert _vector("OFF-5", "get_offload_hit_tokens", "window_off_the_chunk_grid")["output"] == 16
    key = _vector("OFF-2", "get_offload_keys", "b12_b16_shared_hash")["output"][1][2]
    assert base64.b64decode(key["bytes"]) == base64.b64decode(key["block_hash"]) + bytes([0, 0, 0, 1])
    assert _vector("OFF-9", "check_offload_support", "mamba_refused")["error"]["class"] == "UnsupportedHybridError"
    assert _vector("OFF-1", "get_chunk_sizes", "mixed_block_sizes_f2_refused")["error"]["class"] == "ConfigError"


# --------------------------------------------------------------------------- schema


def test_every_vector_validates_against_the_schema() -> None:
    schema = vector_schema()
    for vector in build_vectors():
        assert validate_json(schema, vector) == [], vector["case"]
        answer = {k: v for k, v in vector.items() if k in ("output", "error")}
        assert validate_json(answer_schema(), answer) == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"rule": "clip-1"}, "does not match"),
        ({"input": {"block_ids": [[1]], "budget": [2]}}, "unexpected 'budget'"),
        ({"input": {"block_ids": [[-1]], "budgets": [2]}}, "below 0"),
        ({"error": {"class": "GroupCountError"}}, "exactly one alternative"),
        ({"extra": 1}, "unexpected 'extra'"),
    ],
)
def test_the_schema_rejects_broken_vectors(change: dict[str, Any], problem: str) -> None:
    vector = {**_vector("CLIP-1", "get_exchange_clipped_blocks", "keep_last_n"), **change}
    problems = validate_json(vector_schema(), vector)
    assert any(problem in p for p in problems), problems


def test_published_schemas_are_current() -> None:
    for name, schema in (("vector", vector_schema()), ("answer", answer_schema())):
        path = ROOT / "docs" / "vectors" / f"{name}.schema.json"
        assert path.read_text(encoding="utf-8") == dumps_json(schema), (
            f"{path} is stale; regenerate with: kvspec vectors write vectors && cp vectors/*.schema.json docs/vectors/"
        )


# --------------------------------------------------------------------------- determinism and the sample


def test_same_seed_writes_the_same_bytes(tmp_path: Path) -> None:
    write_vectors(tmp_path / "a", seed=7, count=2)
    write_vectors(tmp_path / "b", seed=7, count=2)
    write_vectors(tmp_path / "c", seed=8, count=2)
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert _tree(tmp_path / "a") != _tree(tmp_path / "c")
    assert build_archive(count=1) == build_archive(count=1)


def test_committed_sample_is_current(vectors_dir: Path) -> None:
    stale = sorted(set(_tree(SAMPLE).items()) ^ set(_tree(vectors_dir).items()))
    assert not stale, f"vectors/ is stale ({stale[0][0]}...); regenerate with: kvspec vectors write vectors"


def test_write_replaces_its_own_set_and_refuses_other_folders(tmp_path: Path) -> None:
    write_vectors(tmp_path / "set", rule="SW-1", count=1)
    write_vectors(tmp_path / "set", rule="TOK-1", count=1)
    assert sorted(p.name for p in (tmp_path / "set").iterdir() if p.is_dir()) == ["TOK-1"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds no manifest\.json"):
        write_vectors(tmp_path / "other")
    with pytest.raises(ConfigError, match="rule: expected one of"):
        build_vectors(rule="NOPE-1")


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32), index=st.integers(min_value=0, max_value=len(CASE_SETS) - 1))
def test_generated_vectors_answer_themselves(seed: int, index: int) -> None:
    case_set = CASE_SETS[index]
    for vector in build_vectors(seed=seed, count=2, rule=case_set.rule):
        assert validate_json(vector_schema(), vector) == []
        expected = {k: v for k, v in vector.items() if k in ("output", "error")}
        # The decoded input gives the same answer again: encoding and decoding round-trip.
        answer = answer_vector(json.loads(json.dumps(vector)))
        if "error" in answer:
            assert answer["error"].pop("message")  # the answer says why; the vector leaves it out
        assert answer == expected


# --------------------------------------------------------------------------- check


def _check(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(["vectors", "check", *argv], out=out), out.getvalue()


def test_check_passes_kvspec_itself_in_one_process(vectors_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    status, text = _check(str(vectors_dir), "--jsonl", "--command", f"{PYTHON_ANSWER} --jsonl", "--report", str(report))
    assert status == 0, text
    total = len(list(vectors_dir.glob("*/*/*.json")))
    assert f"OK: 0 failed, 0 skipped, {total} passed" in text
    assert json.loads(report.read_text())["ok"] is True


def test_check_runs_one_process_per_vector(vectors_dir: Path) -> None:
    # DONE-1 has three vectors: each answer is a new Python importing kvspec (about a second each).
    status, text = _check(str(vectors_dir), "--rule", "DONE-1", "--command", PYTHON_ANSWER)
    assert status == 0, text
    assert "DONE-1" in text
    assert "HMA-1" not in text


def test_check_fails_a_wrong_implementation_naming_its_vectors(vectors_dir: Path) -> None:
    command = f"{shlex.quote(sys.executable)} {IMPLS / 'wrong.py'}"
    report = check_vectors(vectors_dir, command, jsonl=True)
    failing = {(o.vector["rule"], o.vector["function"]) for o in report.outcomes if o.status == "failed"}
    # Front-trimming breaks tail alignment and which pairs the null drop hits; no +1 breaks every SW-1 budget.
    assert failing == {
        ("ALIGN-1", "compute_block_pairs"),
        ("NULL-1", "compute_block_pairs"),
        ("SW-1", "get_blocks_per_sw"),
    }
    names = {o.path.name for o in report.outcomes if o.status == "failed"}
    assert {"tail_alignment.json", "pruned_producer_ids_dropped.json", "w32_b16.json"} <= names
    status, text = _check(str(vectors_dir), "--jsonl", "--command", command)
    assert status == 1
    # The first difference shown per function is a hand-picked case: the rule's own example.
    assert "FAIL SW-1/get_blocks_per_sw/per_group_block_size.json" in text
    assert "FAIL ALIGN-1/compute_block_pairs/tail_alignment.json" in text
    assert "FAILED:" in text


def test_check_reports_bad_answers_as_failures(vectors_dir: Path, tmp_path: Path) -> None:
    for command, problem in (
        ("echo not-json", "not JSON"),
        ("false", "did not answer"),
        ('echo \'{"output": 1, "unsupported": true}\'', "not a valid answer"),
    ):
        report = check_vectors(vectors_dir, command, rule="SW-1")
        assert not report.ok
        assert all(problem in o.problem for o in report.outcomes), (command, report.outcomes[0].problem)


def test_check_refuses_an_invalid_vector_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "SW-1" / "get_blocks_per_sw").mkdir(parents=True)
    (tmp_path / "SW-1" / "get_blocks_per_sw" / "x.json").write_text('{"rule": "SW-1"}')
    with pytest.raises(ConfigError, match="not a valid vector"):
        check_vectors(tmp_path, "true")
    status, _ = _check(str(tmp_path), "--command", "true")
    assert status == 2
    assert "kvspec vectors: ConfigError: vectors check:" in capsys.readouterr().err


def test_check_passes_a_c_implementation_of_two_functions(
    vectors_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        message = "no C compiler (cc, gcc or clang) on PATH"
        if request.config.getoption("--require-backends"):
            pytest.fail(f"--require-backends: {message}", pytrace=False)
        pytest.skip(message)
    binary = tmp_path / "clip_align"
    subprocess.run([compiler, "-O2", "-o", str(binary), str(IMPLS / "clip_align.c")], check=True, timeout=120)
    report = check_vectors(vectors_dir, str(binary))
    assert report.ok, [o.problem for o in report.outcomes if o.status == "failed"]
    answered = {o.vector["function"] for o in report.outcomes if o.status == "passed"}
    assert answered == {"compute_block_pairs", "get_exchange_clipped_blocks"}
    rules = report.by_rule()
    assert rules["ALIGN-1"]["passed"] == rules["ALIGN-1"]["passed"] + rules["ALIGN-1"]["failed"] > 0
    # The same binary against vectors it gets wrong: a hand-edited expectation must fail the run.
    edited = tmp_path / "edited"
    shutil.copytree(vectors_dir, edited)
    path = edited / "ALIGN-1" / "compute_block_pairs" / "tail_alignment.json"
    vector = json.loads(path.read_text())
    vector["output"]["producer_block_ids"][0] = [1, 2]  # the front-trimmed answer
    path.write_text(json.dumps(vector))
    assert not check_vectors(edited, str(binary), function="compute_block_pairs").ok


def test_worked_example_and_null_either_side_are_pinned() -> None:
    pairs = _vector("WIN-1", "compute_transfer_pairs", "worked_example")["output"]
    assert pairs["producer_block_ids"] == [[14, 15, 16, 17], [23, 24, 25, 26, 27]]  # docs/explanation/worked-example.md
    assert pairs["consumer_block_ids"] == [[41, 42, 43, 44], [51, 52, 53, 54, 55]]
    outcomes = {
        case: "error" in _vector("WIN-1", "check_window_coverage", case)
        for case in (
            "t47_null_block0_on_producer",
            "t47_null_block0_on_consumer",
            "t46_null_block0_on_producer",
            "t46_null_block0_on_consumer",
            "worked_example_t94_pruned_with_t",
            "worked_example_t94_pruned_with_t_plus_1",
        )
    }
    assert outcomes == {
        "t47_null_block0_on_producer": False,
        "t47_null_block0_on_consumer": False,
        "t46_null_block0_on_producer": True,
        "t46_null_block0_on_consumer": True,
        "worked_example_t94_pruned_with_t": False,
        "worked_example_t94_pruned_with_t_plus_1": True,
    }


def test_the_docs_attach_the_archive_and_list_every_function(vectors_dir: Path, tmp_path: Path) -> None:
    import importlib.util
    import tarfile

    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("kvspec_docs_hooks_vectors", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    table = hooks.render_vector_functions()
    assert all(f"| `{name}` |" in table for name in FUNCTIONS)
    assert hooks.VECTORS_ARCHIVE == "vectors/kvspec-vectors.tar.gz"
    with tarfile.open(fileobj=io.BytesIO(build_archive()), mode="r:gz") as tar:
        tar.extractall(tmp_path, filter="data")
    assert _tree(tmp_path / "kvspec-vectors") == _tree(vectors_dir)
