"""kvspec.integrations.sglang against SGLang 0.5.23 itself: translation, index building, pairing, the audit.

The tests marked ``sglang`` need SGLang (``kvspec sglang-setup --print | bash``): skipped without it,
failed under ``--require-backends``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvspec_conformance.configs import full, gdn, make_config, mamba, sw

from kvspec import (
    BlockAlignmentError,
    BlockIds,
    IncompatiblePeerError,
    SlidingWindowSpec,
    StatePositionError,
    StateSlotError,
    TransferMode,
    TransferRequest,
    UnsupportedHybridError,
    get_needed_block_range,
)
from kvspec.integrations import sglang as integration
from kvspec.integrations.expectations import expected_names, load_expected

ROOT = Path(__file__).resolve().parent.parent
AUDIT_JSON = ROOT / "docs" / "explanation" / "sglang-audit.json"


def test_import_kvspec_never_imports_sglang() -> None:
    code = "import sys, kvspec.integrations.sglang, kvspec.integrations.sglang_audit; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_pool_config_round_trips() -> None:
    pool = integration.SglangPoolConfig(
        page_size=16,
        full_attention_layer_ids=(0, 1),
        swa_attention_layer_ids=(2, 3, 4),
        sliding_window_size=127,
        head_num=2,
        head_dim=64,
        num_pages=32,
    )
    config = integration.from_sglang_pool_config(pool)
    windows = [g.kv_cache_spec for g in config.kv_cache_groups[1:]]
    assert [s.sliding_window for s in windows if isinstance(s, SlidingWindowSpec)] == [128]  # W = W_sgl + 1
    assert integration.to_sglang_pool_config(config) == pool


def test_pool_config_with_a_mamba_pool_round_trips() -> None:
    pool = integration.SglangPoolConfig(
        page_size=16,
        full_attention_layer_ids=(0,),
        head_num=2,
        head_dim=64,
        num_pages=32,
        mamba_layer_ids=(1, 2, 3),
        mamba_state_shapes=((3, 8), (2, 4, 4)),
        mamba_state_dtypes=("float16", "float32"),
        mamba_type="gdn_attn",
    )
    config = integration.from_sglang_pool_config(pool)
    assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == ["FullAttentionSpec", "MambaSpec"]
    assert integration.to_sglang_pool_config(config) == pool
    with pytest.raises(UnsupportedHybridError, match="one Mamba pool of one state layout"):
        integration.to_sglang_pool_config(make_config(full(16), mamba(16), gdn(16)))


@pytest.mark.parametrize(
    ("shapes", "said"),
    [
        ([full(16), sw(64, 32)], "one page size"),
        ([full(16), sw(64, 16), sw(128, 16)], "one sliding window"),
        ([full(16), mamba(16, mamba_type="short_conv")], "state kinds"),
    ],
)
def test_what_sglang_cannot_represent_is_refused(shapes: Any, said: str) -> None:
    with pytest.raises(UnsupportedHybridError, match=said):
        integration.to_sglang_pool_config(make_config(*shapes))


@pytest.mark.parametrize("name", ["qwen3-next-80b", "kimi-linear-48b", "hymba-1.5b", "mamba-130m"])
def test_state_presets_are_one_mamba_pool(name: str) -> None:
    """Every state layer of a preset lands in SGLang's one Mamba pool, whatever its page size.

    Decision 180 in decisions-engines.md.
    """
    from kvspec.presets import get_preset

    config = get_preset(name).build_config(num_blocks=16)
    pool = integration.to_sglang_pool_config(config)
    states = [g for g in config.kv_cache_groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    assert len(pool.mamba_layer_ids) == sum(len(g.layer_names) for g in states)
    assert pool.mamba_type == states[0].kv_cache_spec.mamba_type  # type: ignore[attr-defined]


def test_the_shipped_lists_are_named() -> None:
    names = expected_names()
    assert {"sglang:mooncake", "sglang:nixl", "sglang:mori", "sglang-audit"} <= set(names)
    assert all(key.endswith("/front-pairs-on-drift") for key in load_expected("sglang-audit"))


def test_setup_installs_the_constraints_list() -> None:
    listed = (ROOT / "kvspec/integrations/constraints/sglang-cpu.txt").read_text(encoding="utf-8")
    pins = [line for line in listed.splitlines() if line and not line.startswith("#")]
    assert "sglang==0.5.23" in pins
    assert all("==" in p for p in pins)
    script = integration.cpu_setup_script()
    assert f"install --no-deps {' '.join(pins)}" in script
    setup = (ROOT / "scripts" / "setup").read_text(encoding="utf-8")
    assert "constraints/sglang-cpu.txt" in setup
    assert "--no-deps $sglang_imports" in setup


# --------------------------------------------------------------------------- SGLang's own code


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("window", "block", "tokens", "prefix"), [(9, 4, 23, 0), (128, 16, 129, 0), (33, 16, 200, 176)]
)
def test_sglang_selects_the_blocks_kvspec_needs(sglang: Any, window: int, block: int, tokens: int, prefix: int) -> None:
    spec = make_config(sw(window, block)).kv_cache_groups[0].kv_cache_spec
    blocks = -(-tokens // block)
    producer = list(range(100, 100 + blocks))
    consumer = list(range(500, 500 + blocks))
    kw = {"first_block": 0, "num_tokens": tokens, "prefix_tokens": prefix}
    needed = get_needed_block_range(spec, num_tokens=tokens, prefix_hit_tokens=prefix)
    assert sglang.producer_pages(spec, producer, **kw) == [producer[b] for b in needed]
    assert sglang.consumer_pages(spec, consumer, **kw) == [consumer[b] for b in needed]


@pytest.mark.sglang
def test_backends_pair_as_sglang_does(sglang: Any) -> None:
    """Equal lists pair index by index; a one-page drift: Mooncake and MORI pair the fronts, NIXL refuses."""
    for backend in ("mooncake", "mori", "nixl"):
        assert sglang.pair_pages(backend, [3, 4, 5], [7, 8, 9]) == ([3, 4, 5], [7, 8, 9])
    for backend in ("mooncake", "mori"):
        assert sglang.pair_pages(backend, [3, 4, 5], [8, 9]) == ([3, 4], [8, 9])  # ALIGN-1 would pair (4, 8), (5, 9)
    with pytest.raises(BlockAlignmentError, match=r"SGLang nixl refuses to pair.*prefill=3, dst=2"):
        sglang.pair_pages("nixl", [3, 4, 5], [8, 9])


@pytest.mark.sglang
def test_connector_seam_pairs_by_position(sglang: Any) -> None:
    config = make_config(full(4), sw(9, 4))
    connector = sglang.make_connector("mooncake")
    connector.check_admission(config, TransferMode.READ)
    producer = BlockIds([[11, 12, 13, 14, 15, 16], [0, 0, 0, 24, 25, 26]])
    consumer = BlockIds([[32, 33, 34, 35, 36], [0, 0, 44, 45, 46]])  # a one-block prefix hit on the full group
    pairs = connector.pair_block_ids(
        config,
        TransferRequest(num_tokens=23, prefix_hit_tokens=4, producer_block_ids=producer, consumer_block_ids=consumer),
    )
    assert [list(g) for g in pairs.producer_block_ids] == [[12, 13, 14, 15, 16], [24, 25, 26]]
    assert [list(g) for g in pairs.consumer_block_ids] == [[32, 33, 34, 35, 36], [44, 45, 46]]


# --------------------------------------------------------------------------- state groups (prebuilt)


@pytest.mark.sglang
def test_one_mamba_slot_moves_through_sglangs_own_code(sglang: Any) -> None:
    """Each side's one slot through SGLang's Mamba payloads; each backend's Mamba path pairs them (STATE-3)."""
    spec = make_config(full(4), mamba(4, num_speculative_blocks=1)).kv_cache_groups[1].kv_cache_spec
    kw = {"first_block": 0, "num_tokens": 10, "prefix_tokens": 0}
    assert sglang.producer_pages(spec, [0, 0, 7, 9], **kw) == [7]  # the scratch slot 9 stays (STATE-2)
    assert sglang.consumer_pages(spec, [5], **kw) == [5]
    for backend in ("mooncake", "nixl", "mori"):
        assert sglang.pair_pages(backend, [7], [5], state=True) == ([7], [5])
        with pytest.raises(StateSlotError, match="single state index"):
            sglang.pair_pages(backend, [7, 8], [5, 6], state=True)
    # Lists SGLang's pool never builds (findings page): Mooncake takes decode's first slot, NIXL sends nothing.
    assert sglang.pair_pages("mooncake", [7], [5, 6], state=True) == ([7], [5])
    assert sglang.pair_pages("nixl", [], [5], state=True) == ([], [])
    with pytest.raises(StateSlotError, match="single state index"):
        sglang.pair_pages("mori", [7], [5, 6], state=True)
    with pytest.raises(StateSlotError, match="null block"):
        sglang.producer_pages(spec, [3, 0, 9], **kw)


def _state_scenario(profile: str = "prebuilt") -> Any:
    from kvspec_conformance import Request, Scenario

    config = make_config(full(4), sw(8, 4), gdn(4, cache_mode="align", num_speculative_blocks=1))
    requests = [
        Request(request_id="a", num_tokens=10),
        Request(request_id="hit", num_tokens=17, prefix_hit_tokens=4),
        Request(request_id="late", num_tokens=9, state_tokens=8),  # P's state stands one token short (STATE-1)
    ]
    return Scenario(config=config, requests=requests, state_profile=profile)


@pytest.mark.sglang
def test_prebuilt_state_exchange_through_the_suite(sglang: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's scenario with SGLang's code: the slot lands, a wrong position and a recompute peer are refused."""
    from kvspec_conformance import run_scenario

    connector = sglang.make_connector("mooncake")
    result = run_scenario(_state_scenario(), connector=connector)
    assert result.ok, result.summary()
    assert result.outcome("a").loaded
    assert result.outcome("hit").loaded
    assert isinstance(result.outcome("late").error, StatePositionError)
    refused = run_scenario(_state_scenario("recompute"), connector=connector)
    assert isinstance(refused.refused, IncompatiblePeerError)
    assert "state_profile" in str(refused.refused)
    assert connector.state_profile(_state_scenario().config) == "prebuilt"

    def with_scratch(spec: Any, block_ids: Any, *, group: int = 0) -> list[int]:
        return [int(block_ids[-1])]  # a broken load: the scratch slot travels instead of the state

    monkeypatch.setattr(sglang, "load_state_slot", with_scratch)
    broken = run_scenario(_state_scenario(), connector=connector)
    assert not broken.ok, broken.summary()


@pytest.mark.sglang
def test_committed_audit_matches_a_fresh_run(sglang: Any) -> None:
    from kvspec.integrations.sglang_audit import run_audit

    committed = json.loads(AUDIT_JSON.read_text(encoding="utf-8"))
    fresh = run_audit(requests=committed["requests"]["mooncake"], seed=committed["seed"])
    assert fresh.to_dict() == committed, (
        "docs/explanation/sglang-audit.json is stale: regenerate it with kvspec sglang-audit --requests "
        f"{committed['requests']['mooncake']} --seed {committed['seed']} --json docs/explanation/sglang-audit.json "
        "(then update docs/explanation/sglang-findings.md)\n" + fresh.render()
    )


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl", "mori"])
def test_every_failing_case_is_a_documented_expected_failure(sglang: Any, backend: str) -> None:
    """The whole suite against SGLang's code: no error, every failure one the findings page explains."""
    listed = ROOT / "kvspec" / "integrations" / "expected" / f"sglang-{backend}.txt"
    command = [sys.executable, "-m", "kvspec", "conform", "loopback", "--connector", f"sglang:{backend}", "-q"]
    out = subprocess.run(
        [*command, "--expect-fail-file", str(listed)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 failed, 0 errors" in out.stdout


@pytest.mark.sglang
def test_the_audit_catches_a_broken_pairing(sglang: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pairing one page off, or reading the null page, is reported by class: the audit can fail."""
    from kvspec.integrations import sglang_audit

    real = sglang.BACKENDS["mooncake"]

    def shifted(producer: Any, consumer: Any, *, window: bool, state: bool = False) -> Any:
        p, c = real(producer, consumer, window=window, state=state)
        return (p[1:], c[:-1]) if window else (p, c)

    def nulled(producer: Any, consumer: Any, *, window: bool, state: bool = False) -> Any:
        p, c = real(producer, consumer, window=window, state=state)
        return ([0, *p[1:]], c) if p and not state else (p, c)

    def foreign_state(producer: Any, consumer: Any, *, window: bool, state: bool = False) -> Any:
        p, c = real(producer, consumer, window=window, state=state)
        return ([x + 1 for x in p], c) if state else (p, c)

    for broken, found in ((shifted, "shifted-pair"), (nulled, "reads-null-block")):
        monkeypatch.setitem(sglang.BACKENDS, "mooncake", broken)
        report = sglang_audit.run_audit(backends=("mooncake",), requests=12, seed=3)
        assert found in {c.deviation for c in report.classes}, report.render()
        assert "needed-block-not-transferred" in {c.deviation for c in report.classes}, report.render()
    monkeypatch.setitem(sglang.BACKENDS, "mooncake", foreign_state)
    report = sglang_audit.run_audit(backends=("mooncake",), requests=3, seed=3)
    assert "state-slot-mismatch" in {c.deviation for c in report.classes}, report.render()


@pytest.mark.parametrize("backend", ["mooncake", "nixl", "mori"])
def test_an_adapter_imports_every_sglang_module_it_calls_when_made(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any case: SGLang's lazy imports (27 s cold) once timed out the first STATE case's deadline."""
    imported: list[str] = []
    monkeypatch.setattr(integration, "check_sglang_version", lambda: None)
    monkeypatch.setattr(integration, "import_sglang", lambda module="sglang": imported.append(module))
    connector = integration.make_connector(backend)
    disagg = "sglang.srt.disaggregation."
    called = {
        "torch",
        "sglang.srt.mem_cache.memory_pool",
        "sglang.srt.mem_cache.common",
        f"{disagg}prefill",
        f"{disagg}decode",
        f"{disagg}base.conn",
        f"{disagg}{backend}.conn",
    }
    assert called <= set(imported)
    imported.clear()
    connector.warm_up()  # what run_suite calls before the first case
    assert called <= set(imported)


# --------------------------------------------------------------------------- many ranks (issue 33, item 6)


def _source_of(copies: Any, consumer_offset: int) -> int:
    """The producer byte a consumer byte is read from, by the copies of one page."""
    for copy in copies:
        if copy.consumer_offset <= consumer_offset < copy.consumer_offset + copy.nbytes:
            return int(copy.producer_offset + consumer_offset - copy.consumer_offset)
    raise AssertionError(f"no copy fills consumer byte {consumer_offset}")


@pytest.mark.sglang
def test_sglang_slices_mamba2_conv_as_one_run_and_gdn_per_sub_block(sglang: Any) -> None:
    """SGLang's own slice functions: a Mamba-2 conv cut as one run, GDN per sub-block, KV replicas from every holder."""
    from kvspec_conformance.cases.parallel import attention_page, gdn_page, mamba2_page

    from kvspec.integrations.sglang_parallel import plan_sglang_consumer_rank
    from kvspec.spec.parallel import compute_rank_copies

    page = mamba2_page(4)  # conv x, B, C: 8 channels each, 2 rows of int8; TP1 -> TP4: 2 channels each per rank
    x_bytes, rank_x = 16, 4
    plan = plan_sglang_consumer_rank([page], producer_tp=1, consumer_tp=4, consumer_rank=0)
    assert _source_of(plan.copies[0], rank_x) < x_bytes  # rank 0's B comes from the prefill's x
    assert _source_of(compute_rank_copies(page, producer_tp=1, consumer_tp=4, consumer_rank=0), rank_x) == x_bytes
    gdn = gdn_page(k_heads=4, v_heads=4)  # conv_shard_groups: each of Q, K, V sliced on its own
    for rank in range(4):
        got = plan_sglang_consumer_rank([gdn], producer_tp=1, consumer_tp=4, consumer_rank=rank).copies[0]
        want = compute_rank_copies(gdn, producer_tp=1, consumer_tp=4, consumer_rank=rank)
        assert all(
            _source_of(got, c.consumer_offset + i) == c.producer_offset + i for c in want for i in range(c.nbytes)
        )
    replicas = plan_sglang_consumer_rank([attention_page(2)], producer_tp=8, consumer_tp=2, consumer_rank=0)
    assert {c.producer_rank for c in replicas.copies[0]} == {0, 1, 2, 3}  # all four holders of head 0 write it


@pytest.mark.sglang
def test_par_cases_under_sglang_mooncake_end_with_no_error(sglang: Any) -> None:
    """--connector sglang:mooncake --rule PAR: 0 errors; every failure one the findings page explains."""
    from kvspec_conformance import run_suite
    from kvspec_conformance._report import Outcome

    connector = integration.make_connector("mooncake")
    report = run_suite(
        "loopback", rules=["PAR"], connector=connector, expected_failures=load_expected("sglang:mooncake")
    )
    assert report.counts()["error"] == 0, report.render()
    assert report.passed, report.render()
    by_id = {r.case_id: r for r in report.results}
    assert by_id["PAR-1/kv-heads-fewer-than-tp"].outcome is Outcome.PASSED  # the #23746 fix holds
    assert by_id["PAR-3/mamba2-n-groups-tp"].outcome is Outcome.EXPECTED_FAILURE
    assert all("cannot express" in r.message for r in report.results if r.outcome is Outcome.SKIPPED)
