"""``vllm:offloading`` against vLLM 0.33.0 itself: the adapter, its agreements and disagreements, the offload audit.

These tests need vLLM (``kvspec[vllm]``): skipped without it, failed under ``--require-backends``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvspec_conformance import Connector, OffloadConnector

from kvspec import (
    LoadSet,
    OffloadConfig,
    StoreSet,
    UnsupportedHybridError,
    get_load_set,
    get_offload_hit_tokens,
    get_store_set,
    map_sub_blocks,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
OFFLOAD_JSON = ROOT / "docs" / "explanation" / "vllm-offload-audit.json"


@pytest.fixture(scope="module")
def adapter(vllm: Any) -> Any:
    from kvspec.integrations.vllm import make_connector

    return make_connector("offloading")


def _config(*shapes: str) -> Any:
    """``full/B4``, ``sw8/B4``, ``mamba/B4`` -> the audit's small config."""
    from kvspec.integrations.vllm_offload_audit import OffloadShape, offload_config

    groups = []
    for text in shapes:
        kind, _, size = text.partition("/B")
        if kind == "full":
            groups.append(OffloadShape(block_size=int(size)))
        elif kind == "mamba":
            groups.append(OffloadShape(block_size=int(size), mamba=True))
        else:
            groups.append(OffloadShape(block_size=int(size), window=int(kind[2:])))
    return offload_config(groups)


F1 = OffloadConfig(blocks_per_chunk=1, hash_block_size=4)


def test_make_connector_builds_both_seams(adapter: Any) -> None:
    assert isinstance(adapter, OffloadConnector)
    assert isinstance(adapter, Connector)
    assert repr(adapter) == "OffloadingConnector(offload_prompt_only=False, retention_interval=0)"


def test_import_kvspec_never_imports_vllm_for_the_offload_audit() -> None:
    code = "import sys, kvspec.integrations.vllm_offload_audit; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


# --------------------------------------------------------------------------- agreements, pinned from vLLM's own tests


def test_hma_test_full_and_window_hit_and_load_agree(adapter: Any) -> None:
    """vLLM's test_two_groups_full_and_sliding_window: N=13 hits 12, loads (0,0..2), (1,1..2) (OFF-5, OFF-6).

    Values as docs/explanation/offload-and-vllm.md quotes them (worked values).
    """
    config = _config("full/B4", "sw8/B4")
    present = [[True] * 3, [True] * 3]
    hit = adapter.get_offload_hit_tokens(
        config, present, request_id="hma", num_tokens=13, local_hit_tokens=0, offload=F1
    )
    assert hit == 12 == get_offload_hit_tokens(config, present, num_tokens=13, local_hit_tokens=0, offload=F1)
    table = [[11, 12, 13, 14], [0, 22, 23, 24]]
    load = adapter.get_load_set(config, table, request_id="hma", num_tokens=12, local_hit_tokens=0, offload=F1)
    assert load.chunks == ((0, 1, 2), (1, 2))
    assert load.block_ids == ((11, 12, 13), (22, 23))
    assert load == get_load_set(config, table, num_tokens=12, local_hit_tokens=0, offload=F1)
    adapter.finish_request("hma")


def test_hma_test_different_block_sizes_agree(adapter: Any) -> None:
    """vLLM's test_two_groups_different_block_sizes: 85 tokens, a 48-token GPU hit, load 32 more (OFF-5, OFF-6).

    Values as docs/explanation/offload-and-vllm.md quotes them (worked values).
    """
    config = _config("full/B12", "full/B16")
    present = [[True] * 7, [True] * 5]
    hit = adapter.get_offload_hit_tokens(
        config, present, request_id="sizes", num_tokens=85, local_hit_tokens=48, offload=F1
    )
    assert hit == 32
    table = [list(range(1, 8)), list(range(101, 106))]
    load = adapter.get_load_set(config, table, request_id="sizes", num_tokens=80, local_hit_tokens=48, offload=F1)
    assert load.chunks == ((4, 5, 6), (3, 4))
    assert load == get_load_set(config, table, num_tokens=80, local_hit_tokens=48, offload=F1)
    adapter.finish_request("sizes")


@pytest.mark.parametrize("local_blocks", [0, 1, 2, 3, 4, 5])
def test_f3_loads_at_every_residue_agree(adapter: Any, local_blocks: int) -> None:
    """f=3: a load starting at L = C // B, for every residue of L mod 3, reads the reference's chunks."""
    config = _config("full/B4", "sw8/B4")
    f3 = OffloadConfig(blocks_per_chunk=3, hash_block_size=4)
    local = 4 * local_blocks
    present = [[True] * 3, [True] * 3]
    rid = f"res{local_blocks}"
    hit = adapter.get_offload_hit_tokens(
        config, present, request_id=rid, num_tokens=37, local_hit_tokens=local, offload=f3
    )
    assert hit == get_offload_hit_tokens(config, present, num_tokens=37, local_hit_tokens=local, offload=f3)
    table = [list(range(1, 10)), [0] * 7 + [27, 28]]
    load = adapter.get_load_set(
        config, table, request_id=rid, num_tokens=local + hit, local_hit_tokens=local, offload=f3
    )
    assert load == get_load_set(config, table, num_tokens=local + hit, local_hit_tokens=local, offload=f3)
    adapter.finish_request(rid)


@settings(max_examples=60, deadline=None)
@given(first=st.integers(0, 40), count=st.integers(0, 20), f=st.integers(1, 6))
@example(first=4, count=5, f=3)  # docs/spec/offload.md OFF-7: L = 4, f = 3; (-L) % f would pair wrongly
@example(first=5, count=4, f=3)  # #42945's store: first index 5, four sources
def test_sub_block_map_is_vllms_worker_and_the_reference(adapter: Any, first: int, count: int, f: int) -> None:
    assert adapter.map_sub_blocks(first, count, blocks_per_chunk=f) == map_sub_blocks(first, count, blocks_per_chunk=f)


def test_store_of_full_attention_agrees(adapter: Any) -> None:
    config = _config("full/B12", "full/B16")
    table = [list(range(1, 9)), list(range(101, 107))]
    store = adapter.get_store_set(
        config, table, request_id="st", num_offloadable_tokens=96, next_chunk=[3, 2], offload=F1
    )
    assert store.chunks == ((3, 4, 5, 6, 7), (2, 3, 4, 5))
    assert store == get_store_set(config, table, num_offloadable_tokens=96, next_chunk=[3, 2], offload=F1)
    adapter.finish_request("st")


# --------------------------------------------------------------------------- disagreements the findings page explains


def test_window_tail_only_store_is_vllms_default(adapter: Any) -> None:
    """OFF-3:stores-window-tail-only: with retention 0 vLLM stores only the window chunks a hit at N - 1 reads."""
    config = _config("full/B4", "sw8/B4")
    table = [list(range(1, 8)), list(range(1001, 1008))]
    store = adapter.get_store_set(
        config, table, request_id="tail", num_offloadable_tokens=25, next_chunk=[0, 0], offload=F1
    )
    reference = get_store_set(config, table, num_offloadable_tokens=25, next_chunk=[0, 0], offload=F1)
    assert store.chunks == ((0, 1, 2, 3, 4, 5), (4, 5))
    assert reference.chunks == ((0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5))
    adapter.finish_request("tail")


def test_dense_retention_stores_every_window_chunk_but_skips_a_partial_one(vllm: Any) -> None:
    """OFF-3:skips-partial-chunk: vLLM never writes a chunk with a null sub-block; the reference writes the rest."""
    from kvspec.integrations.vllm import OffloadingConnector

    dense = OffloadingConnector(retention_interval=None)
    config = _config("full/B4", "sw24/B4")
    f2 = OffloadConfig(blocks_per_chunk=2, hash_block_size=4)
    table = [list(range(1, 16)), [0, *range(1002, 1016)]]
    store = dense.get_store_set(config, table, request_id="p", num_offloadable_tokens=57, next_chunk=[0, 0], offload=f2)
    reference = get_store_set(config, table, num_offloadable_tokens=57, next_chunk=[0, 0], offload=f2)
    assert reference.partial_chunks == ((), (0,))
    assert store.chunks == (reference.chunks[0], reference.complete_chunks[1])
    assert store.num_blocks == (14, 12)


def test_periodic_retention_stores_chunks_a_store_set_cannot_express(vllm: Any) -> None:
    from kvspec.integrations.vllm import OffloadingConnector, OffloadingDisagreementError

    periodic = OffloadingConnector(retention_interval=16)
    config = _config("full/B4", "sw8/B4")
    table = [list(range(1, 11)), list(range(101, 111))]
    with pytest.raises(OffloadingDisagreementError, match=r"group 1 chunks \[2, 3, 6, 7, 8\].*contiguous"):
        periodic.get_store_set(config, table, request_id="x", num_offloadable_tokens=40, next_chunk=[0, 0], offload=F1)


def test_window_one_past_a_chunk_multiple_asks_vllm_for_one_chunk_more(adapter: Any) -> None:
    """OFF-5:vllm-hit-shorter: W = 13, C = 4: vLLM wants 4 window chunks before M = 24, the reference 3."""
    config = _config("full/B4", "sw13/B4")
    present = [
        [False, True, True, True, True, True, False],
        [False, True, False, True, True, True, True],
    ]
    hit = adapter.get_offload_hit_tokens(
        config, present, request_id="w1", num_tokens=31, local_hit_tokens=8, offload=F1
    )
    assert hit == 0
    assert get_offload_hit_tokens(config, present, num_tokens=31, local_hit_tokens=8, offload=F1) == 16
    # With window chunk 2 present as well, both hit 16.
    present[1][2] = True
    hit = adapter.get_offload_hit_tokens(
        config, present, request_id="w1", num_tokens=31, local_hit_tokens=8, offload=F1
    )
    assert hit == 16 == get_offload_hit_tokens(config, present, num_tokens=31, local_hit_tokens=8, offload=F1)
    adapter.finish_request("w1")


def test_mamba_is_a_one_chunk_window_in_vllm(adapter: Any) -> None:
    config = _config("full/B4", "mamba/B4")
    present = [[True] * 4, [True] * 4]
    hit = adapter.get_offload_hit_tokens(config, present, request_id="m", num_tokens=17, local_hit_tokens=0, offload=F1)
    assert hit == 16
    with pytest.raises(UnsupportedHybridError, match=r"group 1 \(kind mamba.*OFF-9"):
        get_offload_hit_tokens(config, present, num_tokens=17, local_hit_tokens=0, offload=F1)
    adapter.finish_request("m")


def test_finish_request_drops_vllms_state(vllm: Any) -> None:
    from kvspec.integrations.vllm import OffloadingConnector

    connector = OffloadingConnector()
    config = _config("full/B4", "sw8/B4")
    connector.get_offload_hit_tokens(
        config, [[True] * 3, [True] * 3], request_id="gone", num_tokens=13, local_hit_tokens=0, offload=F1
    )
    scheduler = connector.scheduler(config, F1)
    assert "gone" in scheduler._req_status
    connector.finish_request("gone")
    assert "gone" not in scheduler._req_status
    assert "gone" not in scheduler.manager.present
    connector.finish_request("gone")  # twice is harmless


def test_results_are_kvspec_models(adapter: Any) -> None:
    config = _config("full/B4", "sw8/B4")
    table = [list(range(1, 8)), list(range(1001, 1008))]
    assert isinstance(
        adapter.get_store_set(config, table, request_id="t", num_offloadable_tokens=12, next_chunk=[0, 0], offload=F1),
        StoreSet,
    )
    assert isinstance(
        adapter.get_load_set(config, table, request_id="t2", num_tokens=12, local_hit_tokens=0, offload=F1), LoadSet
    )
    adapter.finish_request("t")
    adapter.finish_request("t2")


# --------------------------------------------------------------------------- the audit


def test_committed_offload_audit_matches_a_fresh_run(vllm: Any) -> None:
    """The findings page's numbers come from this JSON: a rerun must reproduce it exactly."""
    from kvspec.integrations._vllm_versions import expected_file_stem
    from kvspec.integrations.vllm_offload_audit import run_offload_audit

    # The installed release's audit (vllm-offload-audit.json for 0.33.0, whose numbers the findings page shows).
    path = OFFLOAD_JSON.with_name(expected_file_stem("vllm-offload-audit") + ".json")
    committed = json.loads(path.read_text(encoding="utf-8"))
    fresh = run_offload_audit(seed=committed["seed"], random_requests=committed["random_requests"])
    assert fresh.to_dict() == committed, (
        "docs/explanation/vllm-offload-audit.json is stale: regenerate it with kvspec vllm-audit --offload "
        "--seed 11 --json docs/explanation/vllm-offload-audit.json (then update the findings page)\n" + fresh.render()
    )
    for c in committed["classes"]:
        assert c["verdict"] in {"vLLM bug", "kvspec rule gap", "accepted difference"}, c["class"]


def test_findings_page_names_every_offload_class() -> None:
    page = (ROOT / "docs" / "explanation" / "vllm-findings.md").read_text(encoding="utf-8")
    committed = json.loads(OFFLOAD_JSON.read_text(encoding="utf-8"))
    for c in committed["classes"]:
        assert f"`{c['class']}`" in page, c["class"]
        assert f"{c['cases']} " in page, (c["class"], c["cases"])
    for connector, per_rule in committed["calls"].items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{connector}` |"))
        for rule, calls in per_rule.items():
            assert f"{committed['agreed'][connector][rule]} of {calls}" in row, (connector, rule, row)


def test_audit_catches_a_planted_sub_block_mutant(vllm: Any) -> None:
    """The pre-HMA worker's skip (-L) % f, planted in the adapter: the audit must report an OFF-7 class."""
    from kvspec.integrations.vllm import OffloadingConnector
    from kvspec.integrations.vllm_offload_audit import run_offload_audit

    class NegativeSkip(OffloadingConnector):
        def map_sub_blocks(
            self, first_block_index: int, num_blocks: int, *, blocks_per_chunk: int
        ) -> tuple[tuple[int, int], ...]:
            f = blocks_per_chunk
            skip = (-first_block_index) % f
            return tuple(divmod(skip + i, f) for i in range(num_blocks))

    report = run_offload_audit(seed=3, random_requests=0, connectors={"mutant": NegativeSkip})
    ids = {c.id for c in report.classes}
    assert "OFF-7:sub_blocks" in ids, report.render()
    assert report.agreed["mutant"]["OFF-7"] < report.calls["mutant"]["OFF-7"]


def test_audit_catches_a_planted_hit_mutant(vllm: Any) -> None:
    """A hit one block too long wherever vLLM's is non-zero: the audit reports it, with no verdict to hide behind."""
    from kvspec.integrations.vllm import OffloadingConnector
    from kvspec.integrations.vllm_offload_audit import run_offload_audit

    class LongHit(OffloadingConnector):
        def get_offload_hit_tokens(self, *args: Any, **kwargs: Any) -> int:
            hit = super().get_offload_hit_tokens(*args, **kwargs)
            return hit + 4 if hit else 0

    report = run_offload_audit(seed=3, random_requests=5, connectors={"mutant": LongHit})
    longer = [c for c in report.classes if c.id == "OFF-5:vllm-hit-longer"]
    assert longer, report.render()
    assert longer[0].to_dict()["verdict"] == "unclassified"


def test_cli_offload_audit_runs(vllm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The command line in this process, where vLLM is imported already (decision 147 in decisions-testing.md).
    from kvspec.cli import main

    status = main(["vllm-audit", "--offload", "--requests", "3", "--json", str(tmp_path / "a.json")])
    out = capsys.readouterr()
    assert status == 0, out.err[-2000:]
    assert "OFF-7" in out.out
    assert json.loads((tmp_path / "a.json").read_text(encoding="utf-8"))["random_requests"] == 3


def test_conform_with_vllm_offloading_has_no_error_and_only_listed_failures(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole suite with ``--connector vllm:offloading``: no error, every failure listed (and explained)."""
    from kvspec.cli import main

    # In this process, where vLLM is imported already (decision 147 in decisions-testing.md). The short name reads
    # the installed vLLM release's list.
    status = main(
        ["conform", "loopback", "--connector", "vllm:offloading", "-q", "--expect-fail-file", "vllm:offloading"]
    )
    out = capsys.readouterr()
    assert status == 0, out.out[-4000:] + out.err[-2000:]
    assert " 0 failed, 0 errors" in out.out


def test_vllm_0_33_never_touches_keys(vllm: Any) -> None:
    """OFF-8 describes the #41445-era touch; 0.33.0's scheduler calls no manager.touch on lookup, load or store."""
    from kvspec.integrations.vllm import OffloadingConnector

    connector = OffloadingConnector()
    config = _config("full/B4", "sw8/B4")
    manager = connector.scheduler(config, F1).manager
    touched: list[object] = []
    manager.touch = lambda keys, req_context: touched.append(keys)
    connector.get_offload_hit_tokens(
        config, [[True] * 3, [True] * 3], request_id="t", num_tokens=13, local_hit_tokens=0, offload=F1
    )
    connector.get_load_set(
        config, [[1, 2, 3], [0, 5, 6]], request_id="t", num_tokens=12, local_hit_tokens=0, offload=F1
    )
    connector.get_store_set(
        config, [[1, 2, 3, 4], [0, 5, 6, 7]], request_id="t", num_offloadable_tokens=16, next_chunk=[0, 0], offload=F1
    )
    connector.finish_request("t")
    assert touched == []
    # The spy works: calling the manager's touch records it.
    manager.touch([], None)
    assert touched == [[]]


# --------------------------------------------------------------------------- 0.33's offload rules (issue 26, item 3)


def _random_present(rng: Any, config: Any, num_tokens: int, offload: OffloadConfig) -> list[list[bool]]:
    sizes = [g.kv_cache_spec.block_size * offload.blocks_per_chunk for g in config.kv_cache_groups]
    return [[rng.random() < 0.8 for _ in range(num_tokens // size)] for size in sizes]


def _window_table(config: Any, tokens: int, local: int) -> list[list[int]]:
    """vLLM's allocation for ``tokens``: window blocks wholly before the window of token ``tokens`` are null."""
    table = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        blocks = -(-tokens // spec.block_size)
        window = getattr(spec, "sliding_window", 0) or 0
        first = max(local, tokens - window + 1) // spec.block_size if window else 0
        table.append([0 if k < first else 100 * g + k + 1 for k in range(blocks)])
    return table


@pytest.mark.parametrize(("window", "extra", "f"), [(8, 1, 1), (8, 4, 1), (13, 3, 1), (8, 5, 2), (10, 2, 2)])
def test_extra_retained_tokens_is_a_window_of_w_plus_e_56709(vllm: Any, window: int, extra: int, f: int) -> None:
    """vLLM #56709 (in 0.33.0): a window group retaining E extra tokens hits and loads as kvspec's window of W + E.

    vLLM's spec ``SlidingWindowSpec(sliding_window=W, extra_retained_tokens=E)``
    under the adapter, kvspec's reference on ``sw(W + E)``: every hit and
    every load set agree (decision 118 in decisions-offload.md). The reference on ``sw(W)`` (E
    ignored) would report a longer hit somewhere: it verifies fewer window
    chunks than vLLM's allocation then restores (#56701's "Chunk not found").
    """
    import random

    from kvspec.integrations import vllm as adapters

    wide = _config("full/B4", f"sw{window + extra}/B4")
    narrow = _config("full/B4", f"sw{window}/B4")
    offload = OffloadConfig(blocks_per_chunk=f, hash_block_size=4)
    translate = adapters.to_vllm_kv_cache_config

    def with_extra(config: Any) -> Any:
        vllm_config = translate(config)
        if config == wide:
            group = vllm_config.kv_cache_groups[1]
            spec = group.kv_cache_spec
            group.kv_cache_spec = type(spec)(
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                sliding_window=window,
                extra_retained_tokens=extra,
            )
        return vllm_config

    rng = random.Random(window * 100 + extra * 10 + f)
    longer = loads = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapters, "to_vllm_kv_cache_config", with_extra)
        connector = adapters.OffloadingConnector()
        scheduler = connector.scheduler(wide, offload)
        assert scheduler.config.kv_group_configs[1].kv_cache_spec.extra_retained_tokens == extra
        for i in range(40):
            n = rng.randint(9, 48)
            local = 4 * f * rng.randint(0, (n - 1) // (4 * f)) if rng.random() < 0.5 else 0
            present = _random_present(rng, wide, n, offload)
            rid = f"e{i}"
            hit = connector.get_offload_hit_tokens(
                wide, present, request_id=rid, num_tokens=n, local_hit_tokens=local, offload=offload
            )
            expected = get_offload_hit_tokens(wide, present, num_tokens=n, local_hit_tokens=local, offload=offload)
            assert hit == expected, (n, local, present)
            ignoring = get_offload_hit_tokens(narrow, present, num_tokens=n, local_hit_tokens=local, offload=offload)
            longer += ignoring > hit
            if hit:
                loads += 1
                table = _window_table(wide, local + hit, local)
                load = connector.get_load_set(
                    wide, table, request_id=rid, num_tokens=local + hit, local_hit_tokens=local, offload=offload
                )
                assert load == get_load_set(
                    wide, table, num_tokens=local + hit, local_hit_tokens=local, offload=offload
                )
            connector.finish_request(rid)
    assert loads > 10, "too few hits to compare load sets"
    chunk = 4 * f
    if -(-(window + extra - 1) // chunk) > -(-(window - 1) // chunk):
        assert longer, "ignoring E never changed a hit: the cases do not reach the window's edge"


def test_max_load_tokens_caps_a_hit_on_the_chunk_grid(vllm: Any) -> None:
    """``max_load_tokens`` (a request's kv_transfer_params): vLLM's hit is at most the cap, rounded down to a chunk,
    and never past the rule: every position the token at the hit's end reads is present (OFF-5, decision 119 in
    decisions-offload.md)."""
    import random

    from kvspec.integrations import vllm as adapters

    config = _config("full/B4", "sw8/B4")
    offload = OffloadConfig(blocks_per_chunk=2, hash_block_size=4)
    connector = adapters.OffloadingConnector()
    cap: dict[str, int] = {}
    new_request = connector._new_request

    def capped(request_id: str, num_tokens: int, hash_block_size: int) -> Any:
        request = new_request(request_id, num_tokens, hash_block_size)
        request.kv_transfer_params = {"max_load_tokens": cap[request_id]}
        return request

    rng = random.Random(7)
    shorter = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(connector, "_new_request", capped)
        for i in range(60):
            n = rng.randint(9, 64)
            local = 8 * rng.randint(0, (n - 1) // 8) if rng.random() < 0.4 else 0
            present = _random_present(rng, config, n, offload)
            rid = f"m{i}"
            cap[rid] = rng.randint(0, n)
            hit = connector.get_offload_hit_tokens(
                config, present, request_id=rid, num_tokens=n, local_hit_tokens=local, offload=offload
            )
            free = get_offload_hit_tokens(config, present, num_tokens=n, local_hit_tokens=local, offload=offload)
            assert hit <= cap[rid]
            assert hit <= free
            assert hit % 8 == 0  # on the chunk grid (C_g = 8)
            shorter += hit < free
            if hit:
                # The end is one the rule accepts: the reference, asked for a request ending right after it, agrees.
                end = local + hit
                trimmed = [row[: (end + 1) // 8] for row in present]
                assert (
                    get_offload_hit_tokens(config, trimmed, num_tokens=end + 1, local_hit_tokens=local, offload=offload)
                    == hit
                ), (n, local, present, cap[rid])
            connector.finish_request(rid)
    assert shorter, "no cap ever shortened a hit"


def test_a_sync_load_is_the_same_load_set(vllm: Any) -> None:
    """``sync_load_budget_bytes``: a hit that fits loads inside the step (no async wait); vLLM then finds the load start
    by position among blocks hashed at allocation. The load set is the reference's all the same (OFF-6, decision 120 in
    decisions-offload.md).
    """
    from kvspec.integrations import vllm as adapters

    config = _config("full/B4", "sw8/B4")
    offload = OffloadConfig(blocks_per_chunk=1, hash_block_size=4)
    make_vllm_config = adapters._offloading_vllm_config

    def with_budget(*args: Any, **kwargs: Any) -> Any:
        vllm_config = make_vllm_config(*args, **kwargs)
        vllm_config.kv_transfer_config.kv_connector_extra_config["sync_load_budget_bytes"] = 1 << 30
        return vllm_config

    make_blocks = adapters._kv_cache_blocks

    def hashed_at_allocation(lists: Any, kvspec_config: Any, local_hit_tokens: int) -> Any:
        blocks = make_blocks(lists, kvspec_config, local_hit_tokens)
        for group in blocks.blocks:
            for position, block in enumerate(group):
                if not block.is_null and block.block_hash is None:
                    block.set_block_hash(b"kvspec-sync-load" + position.to_bytes(8, "big"))
        return blocks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapters, "_offloading_vllm_config", with_budget)
        patch.setattr(adapters, "_kv_cache_blocks", hashed_at_allocation)
        connector = adapters.OffloadingConnector()
        scheduler = connector.scheduler(config, offload)
        assert scheduler.config.sync_load_budget_bytes == 1 << 30
        for local in (0, 4, 8):
            rid = f"s{local}"
            present = [[True] * 7, [True] * 7]
            request = connector._request(config, offload, rid, 30)
            scheduler.manager.present[rid] = present
            hit, load_async = scheduler.get_num_new_matched_tokens(request, local)
            scheduler._release_step()
            assert (hit, load_async) == (28 - local, False)  # a sync load: the forward waits for nothing
            table = _window_table(config, 28, local)
            load = connector.get_load_set(
                config, table, request_id=rid, num_tokens=28, local_hit_tokens=local, offload=offload
            )
            assert load == get_load_set(config, table, num_tokens=28, local_hit_tokens=local, offload=offload)
            connector.finish_request(rid)
