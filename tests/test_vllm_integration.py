"""kvspec.integrations.vllm against vLLM 0.33.0 itself: translation, the Connector adapters, and the audit.

These tests need vLLM (``kvspec[vllm]``): skipped without it, failed under ``--require-backends``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kvspec_conformance import run_suite
from kvspec_conformance._report import Outcome
from kvspec_conformance.configs import GroupShape, chunked, full, make_config, mamba, mla, sw, sw_mla

from kvspec import (
    BlockAlignmentError,
    BlockIds,
    ConfigError,
    KVCacheConfig,
    KVSpecError,
    TransferMode,
    TransferRequest,
    UnsupportedHybridError,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
)
from kvspec.cli import main
from kvspec.integrations._vllm_versions import expected_file_stem

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
# The installed vLLM release's committed audit: vllm-audit.json (0.33.0), vllm-audit-0.34.json (0.34.0).
AUDIT_JSON = ROOT / "docs" / "explanation" / (expected_file_stem("vllm-audit") + ".json")


def test_import_kvspec_never_imports_vllm() -> None:
    code = "import sys, kvspec, kvspec.integrations.vllm, kvspec.integrations.vllm_audit; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


# --------------------------------------------------------------------------- translation

SHAPES = st.one_of(
    st.builds(full, st.sampled_from([4, 16, 64])),
    st.builds(mla, st.sampled_from([4, 16])),
    st.builds(sw, st.integers(1, 4096), st.sampled_from([4, 16, 64])),
    st.builds(sw_mla, st.integers(1, 512), st.sampled_from([4, 16])),
    st.builds(chunked, st.integers(1, 512), st.sampled_from([4, 16])),
    st.builds(
        mamba,
        st.sampled_from([4, 16]),
        mamba_type=st.sampled_from(["mamba1", "mamba2", "gdn_attn", "kda"]),
        cache_mode=st.sampled_from(["none", "align"]),
        num_speculative_blocks=st.integers(0, 3),
    ),
)


@given(st.lists(SHAPES, min_size=1, max_size=4), st.sampled_from(["separate", "shared", "per_layer", "layers_first"]))
@example([full(16), sw(512, 16)], "shared")  # Gemma 3's shape
def test_translation_round_trips_exactly(vllm: Any, shapes: list[GroupShape], layout: Any) -> None:
    from kvspec.integrations.vllm import from_vllm_kv_cache_config, to_vllm_kv_cache_config

    config = make_config(*shapes, layout=layout)
    theirs = to_vllm_kv_cache_config(config)
    assert from_vllm_kv_cache_config(theirs) == config
    for mine, group in zip(config.kv_cache_groups, theirs.kv_cache_groups, strict=True):
        assert group.kv_cache_spec.page_size_bytes == mine.kv_cache_spec.page_size_bytes
        assert group.kv_cache_spec.block_size == mine.kv_cache_spec.block_size


def _vllm_config(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig as VConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheTensor

    page = spec.page_size_bytes
    return VConfig(
        num_blocks=8,
        kv_cache_tensors=[KVCacheTensor(size=8 * page, layers=["l0"], layer_stride=0, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )


def test_translation_refuses_what_kvspec_does_not_model(vllm: Any) -> None:
    import torch
    from vllm.v1 import kv_cache_interface as vi

    from kvspec.integrations.vllm import from_vllm_kv_cache_config

    common: dict[str, Any] = {"block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    with pytest.raises(ConfigError, match="RSWASpec has no kvspec counterpart"):
        from_vllm_kv_cache_config(_vllm_config(vi.RSWASpec(**common, rswa_window=64)))
    with pytest.raises(ConfigError, match="SinkFullAttentionSpec has no kvspec counterpart"):
        from_vllm_kv_cache_config(_vllm_config(vi.SinkFullAttentionSpec(**common, sink_len=16)))
    with pytest.raises(ConfigError, match="extra_retained_tokens=4"):
        from_vllm_kv_cache_config(
            _vllm_config(vi.SlidingWindowSpec(**common, sliding_window=64, extra_retained_tokens=4))
        )
    excluded = _vllm_config(vi.FullAttentionSpec(**common))
    excluded.kv_cache_groups[0] = dataclasses.replace(excluded.kv_cache_groups[0], enable_kv_transfer=False)
    with pytest.raises(ConfigError, match="enable_kv_transfer=False"):
        from_vllm_kv_cache_config(excluded)
    # The same spec without the extra field translates: the refusals above are about the field.
    assert from_vllm_kv_cache_config(_vllm_config(vi.SlidingWindowSpec(**common, sliding_window=64))).num_groups == 1


# --------------------------------------------------------------------------- the adapters


def _config(*shapes: GroupShape) -> KVCacheConfig:
    return make_config(*shapes, num_blocks=64)


def test_admission_is_vllms_own(vllm: Any) -> None:
    from kvspec.integrations.vllm import make_connector

    moriio, nixl = make_connector("moriio"), make_connector("nixl")
    hybrid = _config(full(16), sw(64, 16))
    moriio.check_admission(hybrid, TransferMode.READ)
    with pytest.raises(UnsupportedHybridError, match="MoRIIO WRITE mode does not support sliding-window"):
        moriio.check_admission(hybrid, TransferMode.WRITE)
    with pytest.raises(UnsupportedHybridError, match=r"MoRIIO only supports .*ChunkedLocalAttentionSpec"):
        moriio.check_admission(_config(full(16), chunked(64, 16)), TransferMode.READ)
    # Scope difference: NIXL 0.33.0 admits chunked-local and Mamba groups, which kvspec v1 refuses (ADM-1).
    nixl.check_admission(_config(full(16), chunked(64, 16)), TransferMode.READ)
    nixl.check_admission(_config(full(16), mamba(16)), TransferMode.READ)
    with pytest.raises(ConfigError, match="expected one of"):
        make_connector("lmcache")


@given(
    st.sampled_from(["moriio", "nixl", "nixl-push", "mooncake"]),
    st.integers(1, 300),
    st.integers(16, 700),
    st.sampled_from([16, 32]),
)
@example("nixl", 33, 64, 16)  # a list exactly one budget long
def test_clipping_agrees_with_clip_1(vllm: Any, name: str, blocks: int, window: int, block_size: int) -> None:
    from kvspec.integrations.vllm import make_connector

    config = _config(full(block_size), sw(window, block_size))
    ids = BlockIds([list(range(1, blocks + 1)), list(range(1000, 1000 + blocks))])
    assert make_connector(name).clip_block_ids(config, ids) == get_exchange_clipped_blocks(
        ids, get_blocks_per_sw(config)
    )


def test_pairing_calls_vllm_and_keeps_its_message(vllm: Any) -> None:
    from kvspec.integrations.vllm import make_connector

    config = _config(full(16), sw(32, 16))
    nixl, moriio, mooncake = (make_connector(n) for n in ("nixl", "moriio", "mooncake"))
    for connector in (nixl, moriio, mooncake):
        connector.check_admission(config, TransferMode.READ)
        pairs = connector.pair_block_ids(
            config,
            TransferRequest(
                num_tokens=80,
                prefix_hit_tokens=32,
                producer_block_ids=BlockIds([[1, 2, 3, 4, 5], [3, 4, 5]]),
                consumer_block_ids=BlockIds([[13, 14, 15], [13, 14, 15]]),
            ),
        )
        assert pairs.producer_block_ids == BlockIds([[3, 4, 5], [3, 4, 5]])
    one = _config(full(16))
    producer, consumer = BlockIds([[1, 2]]), BlockIds([[5, 6, 7, 8]])  # the consumer holds more than offered

    def pair(connector: Any) -> Any:
        return connector.pair_block_ids(
            one,
            TransferRequest(
                num_tokens=64, prefix_hit_tokens=0, producer_block_ids=producer, consumer_block_ids=consumer
            ),
        )

    with pytest.raises(BlockAlignmentError, match=r"_apply_prefix_caching \(ALIGN-1\): AssertionError"):
        pair(nixl)
    moriio.check_admission(one, TransferMode.READ)
    with pytest.raises(BlockAlignmentError, match="exceed prefill block ids beyond the allowed local tail"):
        pair(moriio)
    with pytest.raises(BlockAlignmentError, match="P num blocks less than D"):
        pair(mooncake)
    # vLLM pairs a pruned producer entry as it is; kvspec's pair type refuses the null block (NULL-1).
    with pytest.raises(BlockAlignmentError, match="null block id 0"):
        nixl.pair_block_ids(
            config,
            TransferRequest(
                num_tokens=80,
                prefix_hit_tokens=0,
                producer_block_ids=BlockIds([[1, 2, 3, 4, 5], [0, 4, 5]]),
                consumer_block_ids=BlockIds([[6, 7, 8, 9, 10], [8, 9, 10]]),
            ),
        )


def test_short_names_run_the_suite(vllm: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvspec.integrations.vllm import make_connector

    report = run_suite("loopback", rules=["CLIP-1", "SW-1"], connector=make_connector("nixl"), max_examples=3)
    assert report.counts()["error"] == 0
    assert all(r.outcome is Outcome.PASSED for r in report.results), report.render()
    # The command line in this process, where vLLM is imported already (decision 147 in decisions-testing.md): a
    # process of its own
    # imports it again (~20 s); the bad name below runs in one and fails before vLLM is needed.
    status = main(["conform", "loopback", "--connector", "vllm:nixl", "--rule", "SW-1", "-q"])
    out = capsys.readouterr()
    assert status == 0, out.out[-2000:] + out.err[-2000:]
    assert "vllm" in out.out
    bad = subprocess.run(
        [sys.executable, "-m", "kvspec", "conform", "--connector", "vllm:nope", "--rule", "SW-1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ,
    )
    assert bad.returncode != 0
    assert "expected one of" in bad.stderr


# --------------------------------------------------------------------------- the audit


def test_reference_connector_has_no_deviation(vllm: Any) -> None:
    from kvspec.integrations.vllm_audit import run_audit

    report = run_audit(connectors=("reference",), requests=40, seed=5)
    # A quarter as many again on state-group configs, a tenth with different speculation on the two engines.
    assert report.requests == {"reference": 40 + 10 + 4}
    assert report.state_requests == 10
    assert report.speculation_requests == 4
    assert report.pairs["reference"] > 0
    assert report.classes == (), report.render()


def test_committed_audit_matches_a_fresh_run(vllm: Any) -> None:
    from kvspec.integrations.vllm_audit import AUDIT_CONNECTORS, run_audit

    committed = json.loads(AUDIT_JSON.read_text(encoding="utf-8"))
    state, speculation = committed["state_requests"], committed["speculation_requests"]
    fresh = run_audit(
        connectors=AUDIT_CONNECTORS,
        requests=committed["requests"]["reference"] - state - speculation,
        seed=committed["seed"],
        state_requests=state,
        speculation_requests=speculation,
    )
    # The two defects only requests with different speculation on the two engines show (issue 35): the default
    # draw must reach them.
    found = {(c.connector, c.deviation) for c in fresh.classes}
    assert {("mooncake", "state-wrong-slot"), ("nixl", "state-position")} <= found, fresh.render()
    assert fresh.to_dict() == committed, (
        "docs/explanation/vllm-audit.json is stale: regenerate it with "
        "python benchmarks/bench_vllm_audit.py --write-json (then update the findings page)\n" + fresh.render()
    )


@pytest.mark.parametrize("name", ["mooncake"])
def test_every_failing_case_is_a_documented_expected_failure(
    vllm: Any, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole suite against vLLM's connector: no error, and every failure is one the findings page explains."""
    # The command line in this process, where vLLM is imported already (decision 147 in decisions-testing.md): a
    # process of its own would
    # import it again (~15 s). test_short_names_run_the_suite runs `kvspec conform --connector vllm:...` in one.
    # The short name reads the installed vLLM release's list (vllm-mooncake.txt for 0.33.0, -0.34.txt for 0.34.0).
    status = main(["conform", "loopback", "--connector", f"vllm:{name}", "-q", "--expect-fail-file", f"vllm:{name}"])
    out = capsys.readouterr()
    assert status == 0, out.out[-4000:] + out.err[-2000:]
    assert " 0 failed, 0 errors" in out.out


def _case(groups: str, num_tokens: int, lookahead: int = 0, cached: int = 0) -> Any:
    from kvspec.integrations.vllm_audit import AuditCase
    from kvspec.integrations.vllm_audit import GroupShape as Shape

    shapes = []
    for text in groups.split("+"):
        kind, _, size = text.strip().partition("/B")
        shapes.append(Shape(block_size=int(size), window=0 if kind == "full" else int(kind[2:])))
    return AuditCase(
        index=0, groups=tuple(shapes), num_tokens=num_tokens, cached_prefix_tokens=cached, lookahead=lookahead
    )


# The smallest reproducers the audit reported (seed 11), pinned: vLLM's own code must keep showing each.
PINNED = [
    ("nixl", "full/B16 + sw32/B16 + sw256/B16", 63, 7, "needed-block-null-on-consumer"),
    ("mooncake", "full/B16 + sw32/B16 + sw256/B16", 63, 7, "needed-block-null-on-consumer"),
    ("moriio", "full/B16 + sw48/B16 + sw4080/B16", 61, 7, "shifted-pair"),
    ("moriio", "full/B16 + sw48/B16 + sw4080/B16", 61, 7, "needed-block-not-transferred"),
    ("moriio", "full/B32 + sw96/B32", 224, 2, "reads-null-block"),
    ("moriio", "full/B16 + sw65/B16", 95, 1, "writes-null-block"),
]


@pytest.mark.parametrize(("connector", "groups", "num_tokens", "lookahead", "deviation"), PINNED)
def test_pinned_reproducers(
    vllm: Any, connector: str, groups: str, num_tokens: int, lookahead: int, deviation: str
) -> None:
    from kvspec.integrations.vllm_audit import audit_case

    case = _case(groups, num_tokens, lookahead)
    _, findings = audit_case(case, connector)
    assert deviation in {f.deviation for f in findings}
    # kvspec's own functions on the same vLLM tables: no deviation (at most a refusal before posting).
    _, reference = audit_case(case, "reference")
    assert reference == [], reference
    # One token fewer and the window boundary (N - W + 1) % B == 0 is gone: so is the NIXL and Mooncake class.
    if deviation == "needed-block-null-on-consumer":
        _, fewer = audit_case(_case(groups, num_tokens - 1, lookahead), connector)
        assert deviation not in {f.deviation for f in fewer}


# --------------------------------------------------------------------------- upstream reports (issue 26, item 6)

REPORTS = sorted((ROOT / "docs" / "explanation").glob("vllm-report-*.md"))
# The classes whose fixes each script applies as a patch; restored after the test.
_V1 = "vllm.distributed.kv_transfer.kv_connector.v1."
_PATCHED = (
    (_V1 + "moriio.moriio_connector", "MoRIIOConnectorScheduler", "on_new_request"),
    (_V1 + "moriio.moriio_connector", "MoRIIOConnectorScheduler", "get_exchange_clipped_blocks"),
    (_V1 + "nixl.pull_scheduler", "NixlPullConnectorScheduler", "_prefill_backoff"),
    (_V1 + "ssm_conv_transfer_utils", "MambaConvSplitInfo", "remote_conv_offsets"),
    (_V1 + "mooncake.mooncake_connector", "MooncakeConnectorScheduler", "get_sw_clipped_blocks"),
)


def test_upstream_reports_reproduce(vllm: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Each report page's script shows the defect on the installed vLLM (0.33 or 0.34), prints what the page says,
    and its fix removes it."""
    from test_docs import extract_blocks

    from kvspec.integrations._vllm_versions import cpu_config_scope
    from kvspec.integrations.vllm import import_vllm  # sets VLLM_TARGET_DEVICE=cpu first, as the scripts do

    owners = [(getattr(import_vllm(module), cls), name) for module, cls, name in _PATCHED]
    assert len(REPORTS) == 6, [p.name for p in REPORTS]
    for page in REPORTS:
        blocks = extract_blocks(page)
        script = next(b for b in blocks if b.language == "python")
        shown = next(b for b in blocks if b.language == "text" and b.line > script.line)
        assert script.skipped, f"{page.name}: the script needs vLLM; mark it <!-- skip --> for test_docs"
        for fix in (False, True):
            source = script.source.replace("APPLY_FIX = False", f"APPLY_FIX = {fix}")
            with pytest.MonkeyPatch.context() as patch:
                # The Mamba-2 script asks for the DS conv layout (setdefault), as NIXL does; undone after the run.
                patch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
                for owner, name in owners:
                    patch.setattr(owner, name, getattr(owner, name))  # undone after the run, whatever it assigns
                with cpu_config_scope():  # 0.34's CPU platform asks for triton-cpu; the scripts build no model runner
                    exec(compile(source, f"{page.name}:{script.line}", "exec"), {"__name__": "__report__"})
            out = capsys.readouterr().out
            assert out.rstrip().endswith("defect absent" if fix else "defect present"), f"{page.name} fix={fix}\n{out}"
            if not fix:
                assert out.strip() == shown.source.strip(), f"{page.name}: the page shows another output\n{out}"


# --------------------------------------------------------------------------- tracker bugs (issue 26, item 5)


def _drive_handoff(
    connector: str, num_tokens: int, *, appended: int = 0, draft_group: int | None = None
) -> tuple[list[list[int]], list[list[int]], object]:
    """One P/D request through vLLM 0.33.0's own managers and connector schedulers, full/B16 + sw32/B16.

    The decoder's prompt is the prefiller's ``num_tokens`` plus ``appended``
    tokens (a proxy that appends the first sampled token, vLLM #50558);
    ``draft_group`` marks that group as a draft model's, as vLLM's planner
    does for EAGLE/MTP layers (``is_eagle_group``, ``is_draft``: vLLM
    #54926). Returns both block tables and the pairs the connector posts, or
    what it raised.
    """
    from kvspec.integrations import vllm as adapters
    from kvspec.integrations import vllm_audit as va

    config = va._config([va.GroupShape(block_size=16), va.GroupShape(block_size=16, window=32)], 256)
    translate = adapters.to_vllm_kv_cache_config

    def with_draft(kvspec_config: KVCacheConfig) -> Any:
        vllm_config = translate(kvspec_config)
        if draft_group is not None:
            group = vllm_config.kv_cache_groups[draft_group]
            spec = dataclasses.replace(group.kv_cache_spec, is_draft=True)
            vllm_config.kv_cache_groups[draft_group] = dataclasses.replace(
                group, kv_cache_spec=spec, is_eagle_group=True
            )
        return vllm_config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapters, "to_vllm_kv_cache_config", with_draft)
        patch.setattr(va, "to_vllm_kv_cache_config", with_draft)
        if draft_group is not None:
            assert with_draft(config).transfer_group_ids == (0, 1)  # 0.33.0 keeps draft groups in the transfer
        p_engine, c_engine = va._engine(config, 16), va._engine(config, 16)
        adapter = va._adapter(connector)
        p_sched = adapter.build_scheduler(config, role="kv_producer", mode=TransferMode.READ)
        c_sched = adapter.build_scheduler(config, role="kv_consumer", mode=TransferMode.READ)
    hooks = adapter.shape(c_sched)
    tokens = list(range(1, num_tokens + 1))
    p_req = va._request(p_engine, "r", tokens, {"do_remote_decode": True, "transfer_id": "r"})
    if hasattr(p_sched, "on_new_request"):
        p_sched.on_new_request(p_req)
    p_sched.get_num_new_matched_tokens(p_req, 0)
    va._prefill(p_engine, p_req, 0)
    p_req.append_output_token_ids(7)
    p_req.status = adapters.import_vllm("vllm.v1.request").RequestStatus.FINISHED_LENGTH_CAPPED
    manager, computed = p_engine.manager, p_req.num_computed_tokens
    manager.remove_skipped_blocks(
        request_id="r", processed_computed_tokens=computed, num_prompt_tokens=p_req.num_prompt_tokens
    )
    p_table = [list(g) for g in manager.get_block_ids("r")]
    _, returned = p_sched.request_finished(
        p_req, manager.get_block_ids_for_computed_tokens(request_id="r", num_computed_tokens=computed)
    )
    remote = va._tuples(hooks.sent_block_ids(p_sched, "r", returned))
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [list(g) for g in remote],
        "remote_engine_id": "producer",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 0,
        "remote_bootstrap_addr": "127.0.0.1:0",
        "transfer_id": "r",
    }
    c_req = va._request(c_engine, "r", tokens + [7] * appended, params)
    if hasattr(c_sched, "on_new_request"):
        c_sched.on_new_request(c_req)
    c_manager = c_engine.manager
    blocks, hit, *_ = c_manager.get_computed_blocks(c_req)
    external, load_async = c_sched.get_num_new_matched_tokens(c_req, hit)
    c_manager.allocate_slots(
        c_req,
        0 if load_async else c_req.num_tokens - hit - external,
        num_new_computed_tokens=hit,
        new_computed_blocks=blocks,
        num_external_computed_tokens=external,
        delay_cache_blocks=load_async,
    )
    c_table = [list(g) for g in c_manager.get_block_ids("r")]
    try:
        _, pairs = va._pair(
            connector, hooks, (config, config), c_sched, c_manager, c_req, remote, external, num_tokens, hit
        )
    except (KVSpecError, AssertionError, ValueError) as exc:
        return p_table, c_table, exc
    return p_table, c_table, pairs


def _by_position(p_table: list[list[int]], c_table: list[list[int]], pairs: object) -> list[list[tuple[int, int]]]:
    """Each posted pair as (producer logical block, consumer logical block); nulls left out."""
    assert isinstance(pairs, tuple), pairs
    return [
        [(p_ids.index(p), c_ids.index(c)) for p, c in group if p and c]
        for group, p_ids, c_ids in zip(pairs, p_table, c_table, strict=True)
    ]


@pytest.mark.parametrize(
    ("connector", "outcome"),
    [
        ("nixl", "AssertionError"),  # NixlBaseConnectorWorker._apply_prefix_caching: a bare assert
        ("mooncake", "P num blocks less than D"),  # MooncakeConnectorWorker._build_transfer_params
        ("moriio", None),  # loads N tokens; its decode tail allowance keeps the head: right pairs
        ("reference", None),  # kvspec lists the blocks of the N transferred tokens only
    ],
)
def test_proxy_appended_token_at_a_block_boundary_50558(vllm: Any, connector: str, outcome: str | None) -> None:
    """vLLM #50558: the decoder's prompt has the first sampled token appended, N % B == 0, one block more.

    Recorded on the findings page (tracker bugs checked against vLLM 0.33.0). At N = 40 (not a
    boundary) every connector pairs by position.
    """
    for n, boundary in ((32, True), (40, False)):
        p_table, c_table, result = _drive_handoff(connector, n, appended=1)
        assert len(c_table[0]) == len(p_table[0]) + boundary  # the extra block the appended token needs
        if boundary and outcome is not None:
            assert isinstance(result, KVSpecError if connector == "reference" else BlockAlignmentError), result
            assert outcome in str(result)
            continue
        by_position = _by_position(p_table, c_table, result)
        assert all(p == c for group in by_position for p, c in group), by_position
        assert len(by_position[0]) == -(-n // 16), by_position  # every block of the N tokens
        assert by_position[1], by_position


@pytest.mark.parametrize("connector", ["nixl", "mooncake", "moriio"])
def test_a_draft_group_is_transferred_54926(vllm: Any, connector: str) -> None:
    """vLLM #54926: draft-model (MTP) groups were left out of the transfer. 0.33.0 keeps them in it.

    Group 1 marked as vLLM's planner marks an EAGLE/MTP draft group: it stays
    in ``transfer_groups`` and its blocks are paired like any other group's.
    kvspec's side: ``from_vllm_kv_cache_config`` refuses a group excluded from
    transfer by name, and the suite's mutant ``SkipsLastGroup`` fails ALIGN-1.
    """
    p_table, c_table, pairs = _drive_handoff(connector, 47, draft_group=1)
    by_position = _by_position(p_table, c_table, pairs)
    assert by_position[1], f"{connector}: the draft group was not transferred: {pairs}"
    assert all(p == c for group in by_position for p, c in group), by_position


# --------------------------------------------------------------------------- many ranks (issue 33, item 6)


def _source_of(copies: Any, consumer_offset: int) -> int:
    """The producer byte a consumer byte is read from, by the copies of one page."""
    for copy in copies:
        if copy.consumer_offset <= consumer_offset < copy.consumer_offset + copy.nbytes:
            return int(copy.producer_offset + consumer_offset - copy.consumer_offset)
    raise AssertionError(f"no copy fills consumer byte {consumer_offset}")


def test_nixl_mapping_reads_c_as_b_for_mamba2_n_groups_1_55208(vllm: Any) -> None:
    """vLLM's remote_conv_offsets, TP1 -> TP2, n_groups=1: rank 1's B comes from the prefill's C; kvspec's from B."""
    from kvspec_conformance.cases.parallel import mamba2_page

    from kvspec.integrations.vllm_parallel import plan_nixl_consumer_rank
    from kvspec.spec.parallel import compute_rank_copies, get_rank_page_map

    page = mamba2_page(1)  # conv x (4 heads x 2), B (1 group x 2), C (1 x 2), 2 rows of int8: x 16 B, B 4 B, C 4 B
    x_bytes, group_bytes = 16, 4
    consumer_b = x_bytes // 2  # rank 1's B follows its half of x
    # Where each consumer byte's canonical byte is: rank 1's B must be the canonical B.
    run = next(r for r in get_rank_page_map(page, tp_size=2, tp_rank=1) if r.rank_offset == consumer_b)
    assert run.canonical_offset == x_bytes
    plan = plan_nixl_consumer_rank([page], producer_tp=1, consumer_tp=2, consumer_rank=1)
    assert _source_of(plan.copies[0], consumer_b) == x_bytes + group_bytes  # the prefill's C (#55208)
    kvspec = compute_rank_copies(page, producer_tp=1, consumer_tp=2, consumer_rank=1)
    assert _source_of(kvspec, consumer_b) == x_bytes
    # Rank 0's C is read past the conv state, from the SSM state.
    rank0 = plan_nixl_consumer_rank([page], producer_tp=1, consumer_tp=2, consumer_rank=0)
    assert _source_of(rank0.copies[0], x_bytes // 2 + group_bytes) >= x_bytes + 2 * group_bytes
    # With n_groups = TP the same mapping reads right: the defect is the replicated sub-block only.
    sharded = mamba2_page(2)
    for rank in (0, 1):
        got = plan_nixl_consumer_rank([sharded], producer_tp=1, consumer_tp=2, consumer_rank=rank).copies[0]
        want = compute_rank_copies(sharded, producer_tp=1, consumer_tp=2, consumer_rank=rank)
        assert {(_source_of(got, c.consumer_offset + i)) for c in want for i in range(c.nbytes)} == {
            c.producer_offset + i for c in want for i in range(c.nbytes)
        }


def test_par_cases_under_nixl_end_with_no_error_and_55208_expected(vllm: Any) -> None:
    """--connector vllm:nixl --rule PAR: 0 errors, #55208 an expected failure, what vLLM lacks skipped by name."""
    from kvspec_conformance._parallel_scenario import run_par_scenario
    from kvspec_conformance.cases.parallel import SCENARIOS

    from kvspec.integrations.expectations import load_expected
    from kvspec.integrations.vllm import make_connector
    from kvspec.transport import load_backend

    nixl = make_connector("nixl")
    report = run_suite("loopback", rules=["PAR"], connector=nixl, expected_failures=load_expected("vllm:nixl"))
    assert report.counts()["error"] == 0, report.render()
    assert report.passed, report.render()
    by_id = {r.case_id: r for r in report.results}
    ngroups = by_id["PAR-3/mamba2-n-groups-1"]
    assert ngroups.outcome is Outcome.EXPECTED_FAILURE
    assert "#55208" in ngroups.message
    assert "holds conv.C[0]" in ngroups.message  # rank 1's B holds the prefill's C
    skipped = [r for r in report.results if r.outcome is Outcome.SKIPPED]
    assert skipped
    assert all("cannot express" in r.message for r in skipped)
    assert by_id["PAR-1/tp-1-to-8"].outcome is Outcome.PASSED  # vLLM's head mapping agrees with kvspec's
    # The same scenario with kvspec's planner is clean.
    backend = load_backend("loopback")
    try:
        assert run_par_scenario(SCENARIOS["PAR-3/mamba2-n-groups-1"], backend=backend).problems == ()
        assert run_par_scenario(SCENARIOS["PAR-3/mamba2-n-groups-1"], backend=backend, connector=nixl).problems
    finally:
        backend.close()


def test_nixl_head_mapping_agrees_with_kvspec_on_every_tp_pair_it_admits(vllm: Any) -> None:
    """K in {1, 2, 4, 8} KV heads, P != D in {1, 2, 4, 8}, every decode rank: the same source byte for each byte.

    vLLM refuses P TP > D TP when P replicates heads (P > K); every other pair it maps as kvspec does.
    """
    from kvspec_conformance.cases.parallel import attention_page

    from kvspec.integrations.vllm_parallel import plan_nixl_consumer_rank
    from kvspec.spec.parallel import compute_rank_copies

    refused = set()
    for heads in (1, 2, 4, 8):
        page = attention_page(heads)
        for p_tp in (1, 2, 4, 8):
            for d_tp in (1, 2, 4, 8):
                if p_tp == d_tp:
                    continue
                try:
                    plans = [
                        plan_nixl_consumer_rank([page], producer_tp=p_tp, consumer_tp=d_tp, consumer_rank=rank)
                        for rank in range(d_tp)
                    ]
                except NotImplementedError:
                    refused.add((heads, p_tp, d_tp))
                    continue
                for rank, plan in enumerate(plans):
                    want = compute_rank_copies(page, producer_tp=p_tp, consumer_tp=d_tp, consumer_rank=rank)
                    got = {
                        (c.producer_rank, c.producer_offset + i, c.consumer_offset + i)
                        for c in plan.copies[0]
                        for i in range(c.nbytes)
                    }
                    assert got == {
                        (c.producer_rank, c.producer_offset + i, c.consumer_offset + i)
                        for c in want
                        for i in range(c.nbytes)
                    }, (heads, p_tp, d_tp, rank)
    assert refused == {(k, p, d) for k in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8) if d < p and p > k}


def test_tp_audit_finds_the_mamba2_classes_and_no_attention_deviation(
    vllm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvspec vllm-audit --tp: random layers and TP pairs through vLLM's NIXL mapping; Mamba-2's B and C deviate."""
    from kvspec.integrations.vllm_parallel import audit_tp_pairs

    report = audit_tp_pairs(requests=60, seed=11)
    assert set(report.classes) == {"mamba2/conv.B", "mamba2/conv.C"}, report.render()
    assert all(f.draw.groups == 1 for f in report.findings)  # n_groups = TP maps right; n_groups=1 does not
    assert {f.draw.producer_tp > f.draw.consumer_tp for f in report.findings} == {True, False}  # both directions
    assert main(["vllm-audit", "--tp", "--requests", "60"]) == 1
    assert "FAILED tp/mamba2/conv.B: found, not expected" in capsys.readouterr().out
    listed = tmp_path / "tp.txt"
    listed.write_text("tp/mamba2/conv.B=#55208\ntp/mamba2/conv.C=#55208\n", encoding="utf-8")
    assert main(["vllm-audit", "--tp", "--requests", "60", "--expect-file", str(listed)]) == 0
    assert "PASSED: 0 unexpected" in capsys.readouterr().out
