"""What an engine pays per request: clip both sides, coverage, pairs, plan; and vLLM 0.33's own code on the same lists.

Inputs are what an engine holds: a tuple of plain ``list[int]`` per side, one
list per KV-cache group, ids drawn from a free list (in order, or shuffled as a
busy pool hands them out), nulls where sliding-window pruning put them on the
producer and where the consumer allocates nothing. Every step an engine runs
per request is timed on those lists:

1. ``get_exchange_clipped_blocks`` on the producer's and the consumer's lists (CLIP-1);
2. ``compute_transfer_pairs``: coverage (WIN-1) and pairing (ALIGN-1, NULL-1);
3. ``plan_transfer`` over all layers (PLAN-1) and ``to_descriptors``.

When vLLM is importable (0.33), the same lists go through vLLM's own clip
(MoRI-IO's ``get_exchange_clipped_blocks``), pairing (NIXL's
``_apply_prefix_caching``) and NIXL descriptor-id computation
(``_compute_desc_ids``), called on stand-ins that hold only the attributes
those methods read; the table prints the ratio. The definition's planner
(``compute_page_copies``, ``plan_transfer``'s fallback) is timed once per row as the baseline.

State hybrids (Qwen3-Next: GDN + FA; Hymba: Mamba + SW + FA) run at 128k tokens
after the attention models. Their state groups hold one slot per request;
kvspec's own functions clip it (``get_state_clipped_blocks``, STATE-2) and
pair it (``compute_transfer_pairs``, STATE-3), and the planner moves each
state tensor's bytes (PLAN-1). The line "per-group figure" prints each state hybrid's
clip + pairs + plan + descriptors time per KV-cache group as a ratio to
Gemma 3 27B's (the sliding-window model) at the same length and allocation;
the target is at most 1.2.

Many-to-many (issue 33): the lines "PAR" time, on a 128k-token request, the
per-request PAR functions (for every consumer rank: its faced ranks, its copies
of each group's page, and every producer rank's completion count), the
many-to-many planner (``summarize_parallel_plan``: what each consumer rank reads
from which producer rank, the plan ``kvspec plan`` prints) and the equal-TP
planner (``plan_transfer``), each as a ratio over touching every id both engines
hand over once (a plain loop adding them up); the goal is at most 5x.

Run: ``python benchmarks/bench_engine.py`` (``--quick`` for 8k and 32k only,
``--json PATH`` to write the results, ``--passes 3`` to spread the measurements
over minutes; docs/_data/engine_bench.json, written with ``--passes 3``, is what
the docs page plots).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs

import kvspec
import kvspec.fast
from kvspec import KVCacheConfig, TransferMode, TransferRequest
from kvspec.protocol._plan import _plan_by_definition
from kvspec.protocol._summary import summarize_parallel_plan
from kvspec.spec.parallel import compute_rank_copies, get_candidate_ranks, get_completion_count
from kvspec.spec.state import get_state_clipped_blocks

MODELS = ("gemma-3-27b", "gpt-oss-120b")
TOKENS = (8 * 1024, 32 * 1024, 128 * 1024)
STATE_MODELS = ("qwen3-next-80b", "hymba-1.5b")
STATE_TOKENS = (128 * 1024,)
PAR_CASES = (("qwen3-next-80b", 1, 4), ("qwen3-next-80b", 8, 16), ("gemma-3-27b", 8, 16))
PAR_TOKENS = 128 * 1024
PAR_GOAL = 5.0
PER_GROUP_BASELINE = "gemma-3-27b"
PER_GROUP_TARGET = 1.2
ALLOCATIONS = ("contiguous", "shuffled")
GOALS = {"reference_us": 1000.0, "plan_ms_shuffled": 20.0, "plan_ms_contiguous": 2.0}
DEFAULT_JSON = Path(__file__).resolve().parent.parent / "docs" / "_data" / "engine_bench.json"


@attrs.frozen(kw_only=True)
class EngineRequest:
    """One request as the two engines hold it: plain lists, nulls included."""

    model: str
    num_tokens: int
    allocation: str
    config: KVCacheConfig
    producer: tuple[list[int], ...]
    consumer: tuple[list[int], ...]

    @property
    def ids_in(self) -> int:
        """Ids both sides hand over, nulls included."""
        return sum(map(len, self.producer)) + sum(map(len, self.consumer))


def build_request(model: str, num_tokens: int, allocation: str, seed: int = 0) -> EngineRequest:
    """Both sides' block tables for one request with no prefix hit, each side drawing from its own pool.

    P holds ``cdiv(T, B_g)`` ids per group, then prunes its sliding-window
    groups as vLLM's ``remove_skipped_blocks`` does. C allocates only the
    blocks a sliding window still needs and holds nulls before them, as vLLM's
    allocator does for skipped blocks (docs/spec/alignment-and-coverage.md).
    ``shuffled`` draws ids from a shuffled free list (a pool that has served
    many requests); ``contiguous`` from a fresh one.
    """
    preset = kvspec.presets.get_preset(model)
    sizing = preset.build_config(num_blocks=2)
    # Twice what one request's table needs on one side (null block included): a pool with room to spare.
    needed = 1 + sum(-(-num_tokens // g.kv_cache_spec.block_size) for g in sizing.kv_cache_groups)
    config = preset.build_config(num_blocks=2 * needed)
    rng = random.Random(seed)

    def pool() -> list[int]:
        free = list(range(1, config.num_blocks))
        if allocation == "shuffled":
            rng.shuffle(free)
        free.reverse()  # pop() takes from the front
        return free

    p_free, c_free = pool(), pool()
    producer, consumer = [], []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, kvspec.MambaSpec):
            # One state slot per request (cache mode "none"), then the speculative scratch slots (STATE-2).
            slots = 1 + spec.num_speculative_blocks
            producer.append([p_free.pop() for _ in range(slots)])
            consumer.append([c_free.pop() for _ in range(slots)])
            continue
        total = kvspec.get_logical_block_count(spec, num_tokens=num_tokens)
        producer.append([p_free.pop() for _ in range(total)])
        start = kvspec.get_needed_block_range(spec, num_tokens=num_tokens, prefix_hit_tokens=0).start
        consumer.append([kvspec.NULL_BLOCK_ID] * start + [c_free.pop() for _ in range(total - start)])
    pruned = [
        ids if isinstance(group.kv_cache_spec, kvspec.MambaSpec) else pruned_ids
        for group, ids, pruned_ids in zip(
            config.kv_cache_groups,
            producer,
            kvspec.fast.get_pruned_block_ids(config, producer, num_computed_tokens=num_tokens).to_lists(),
            strict=True,
        )
    ]
    return EngineRequest(
        model=model,
        num_tokens=num_tokens,
        allocation=allocation,
        config=config,
        producer=tuple(pruned),
        consumer=tuple(consumer),
    )


def best_time(fn: Callable[[], object], *, budget_s: float = 0.5, rounds: int = 15) -> float:
    """Best per-call seconds over ``rounds`` rounds of as many calls as fit ``budget_s / rounds``."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    number = max(1, int(budget_s / rounds / once))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


# --------------------------------------------------------------------------- kvspec


def kvspec_steps(req: EngineRequest, *, baseline: bool = True) -> dict[str, Any]:
    """Time each step kvspec runs per request, on the engine's lists (and the definition's planner once)."""
    config, budgets, t = req.config, kvspec.get_blocks_per_sw(req.config), req.num_tokens
    has_state = any(isinstance(g.kv_cache_spec, kvspec.MambaSpec) for g in config.kv_cache_groups)

    def clip(lists: Sequence[Sequence[int]]) -> kvspec.BlockIds:
        clipped = kvspec.fast.get_exchange_clipped_blocks(lists, budgets)  # CLIP-1
        # STATE-2: one slot per state group, as the reference connector's clip_block_ids does.
        return get_state_clipped_blocks(config, clipped) if has_state else clipped

    def clip_both() -> tuple[kvspec.BlockIds, kvspec.BlockIds]:
        return clip(req.producer), clip(req.consumer)  # P before advertising, C symmetric (CLIP-1, STATE-2)

    producer, consumer = clip_both()

    def pairs_of(p: kvspec.BlockIds, c: kvspec.BlockIds) -> kvspec.BlockPairs:
        # compute_transfer_pairs pairs state groups by STATE-3 and attention groups by ALIGN-1.
        return kvspec.fast.compute_transfer_pairs(
            config, TransferRequest(num_tokens=t, prefix_hit_tokens=0, producer_block_ids=p, consumer_block_ids=c)
        )

    def reference() -> kvspec.BlockPairs:
        return pairs_of(*clip_both())

    pairs = reference()
    plan = kvspec.plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    baseline_s = float("nan")
    if baseline:
        start = time.perf_counter()
        page_by_page = _plan_by_definition(config, config, pairs)
        baseline_s = time.perf_counter() - start
        if page_by_page != plan:
            raise AssertionError(f"{req.model} {t} {req.allocation}: fast plan differs from the definition's plan")
    result = {
        "ids_kept": producer.num_blocks + consumer.num_blocks,
        "pairs": pairs.num_pairs,
        "pages": plan.num_pages,
        "descriptors": plan.num_descriptors,
        "clip_us": best_time(clip_both) * 1e6,
        "pairs_us": best_time(lambda: pairs_of(producer, consumer)) * 1e6,
        "reference_us": best_time(reference) * 1e6,
        "plan_ms": best_time(lambda: kvspec.plan_transfer(producer_config=config, consumer_config=config, pairs=pairs))
        * 1e3,
        "descriptors_ms": best_time(lambda: plan.to_descriptors(TransferMode.READ)) * 1e3,
    }
    if baseline:
        result["plan_page_by_page_ms"] = baseline_s * 1e3
    return result


# --------------------------------------------------------------------------- many-to-many (PAR)


def touch_every_id(req: EngineRequest) -> int:
    """The baseline: every id both engines hand over, read once in a plain loop."""
    total = 0
    for ids in (*req.producer, *req.consumer):
        for block_id in ids:
            total += block_id
    return total


def par_steps(model: str, producer_tp: int, consumer_tp: int, allocation: str = "shuffled") -> dict[str, Any]:
    """Time the per-request PAR functions, the many-to-many planner and the equal-TP planner on one 128k request."""
    req = build_request(model, PAR_TOKENS, allocation)
    config = req.config
    preset = kvspec.presets.get_preset(model)
    pages = [preset.get_canonical_page(g.kv_cache_spec) for g in config.kv_cache_groups]

    def par_functions() -> None:
        for rank in range(consumer_tp):
            get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=rank)
            for page in pages:
                compute_rank_copies(page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=rank)
        for rank in range(producer_tp):
            get_completion_count(producer_tp=producer_tp, consumer_tp=consumer_tp, producer_rank=rank)

    def many_to_many() -> object:
        return summarize_parallel_plan(
            config, pages, num_tokens=PAR_TOKENS, producer_tp=producer_tp, consumer_tp=consumer_tp
        )

    steps = kvspec_steps(req, baseline=False)
    base_us = best_time(lambda: touch_every_id(req)) * 1e6
    row = {
        "model": model,
        "producer_tp": producer_tp,
        "consumer_tp": consumer_tp,
        "allocation": allocation,
        "ids_in": req.ids_in,
        "touch_us": base_us,
        "par_functions_us": best_time(par_functions) * 1e6,
        "many_to_many_us": best_time(many_to_many) * 1e6,
        "equal_tp_plan_us": steps["plan_ms"] * 1e3,
    }
    return row


def print_par(rows: Sequence[dict[str, Any]]) -> None:
    """Each PAR figure as a ratio over touching every id once (goal: at most 5x)."""
    for row in rows:
        base = row["touch_us"]
        print(
            f"PAR {row['model']} TP{row['producer_tp']} -> TP{row['consumer_tp']}, {PAR_TOKENS} tokens, "
            f"{row['allocation']} ({row['ids_in']} ids, touched in {base:.0f} us): "
            f"PAR functions {row['par_functions_us']:.0f} us = {row['par_functions_us'] / base:.2f}x, "
            f"many-to-many planner {row['many_to_many_us']:.0f} us = {row['many_to_many_us'] / base:.2f}x, "
            f"equal-TP planner {row['equal_tp_plan_us']:.0f} us = {row['equal_tp_plan_us'] / base:.2f}x "
            f"(goal <= {PAR_GOAL:g}x)",
            flush=True,
        )


# --------------------------------------------------------------------------- vLLM 0.33, called, never copied


def load_vllm() -> SimpleNamespace | None:
    """vLLM's classes the comparison calls, or None when vLLM is not importable."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import torch
        from vllm import __version__ as version
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import MoRIIOConnectorScheduler
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
        from vllm.v1 import kv_cache_interface
    except Exception as exc:  # any import failure means: no comparison
        print(f"vLLM not importable ({type(exc).__name__}: {exc}); kvspec only", file=sys.stderr)
        return None
    return SimpleNamespace(
        version=version,
        torch=torch,
        moriio=MoRIIOConnectorScheduler,
        nixl=NixlBaseConnectorWorker,
        kvi=kv_cache_interface,
    )


def _vllm_config(vllm: SimpleNamespace, config: KVCacheConfig) -> Any:
    """vLLM's own KVCacheConfig for the same groups (it only needs the groups here)."""
    kvi, groups = vllm.kvi, []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        common = {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,  # type: ignore[attr-defined]
            "head_size": spec.head_size,  # type: ignore[attr-defined]
            "dtype": vllm.torch.bfloat16,
        }
        if isinstance(spec, kvspec.SlidingWindowSpec):
            vspec = kvi.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
        else:
            vspec = kvi.FullAttentionSpec(**common)
        groups.append(kvi.KVCacheGroupSpec(layer_names=list(group.layer_names), kv_cache_spec=vspec))
    return kvi.KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_steps(vllm: SimpleNamespace, req: EngineRequest) -> dict[str, Any]:
    """vLLM 0.33's clip (MoRI-IO), pairing (NIXL) and NIXL descriptor ids on the same lists."""
    config = req.config
    # Stand-ins hold exactly the attributes the called methods read; the methods are vLLM's.
    scheduler = SimpleNamespace(
        kv_cache_config=_vllm_config(vllm, config),
        _is_hma_required=kvspec.is_hma_required(config),
        blocks_per_sw=list(kvspec.get_blocks_per_sw(config)),
    )
    # HMA in vLLM: groups share tensors, one NIXL region per layer slot of a group (base_worker's note).
    regions = max(len(g.layer_names) for g in config.kv_cache_groups)
    worker = SimpleNamespace(
        _has_mamba=False,
        _transfer_layer_group_ids=[],
        num_regions=regions,
        block_len_per_layer=[0] * regions,
        region_group_ids=[-1] * regions,
        _uses_region_group_mapping=False,
    )
    clip, pair, desc_ids = (
        vllm.moriio.get_exchange_clipped_blocks,
        vllm.nixl._apply_prefix_caching,
        vllm.nixl._compute_desc_ids,
    )

    def clip_and_pair() -> tuple[Any, Any]:
        remote = clip(scheduler, list(req.producer))
        local = clip(scheduler, list(req.consumer))
        return pair(worker, local, remote, 1, 1)

    local, remote = clip_and_pair()

    def descriptor_ids() -> tuple[Any, Any]:
        return (
            desc_ids(worker, local, config.num_blocks, None, 1),
            desc_ids(worker, remote, config.num_blocks, None, 1),
        )

    return {
        "vllm_clip_pair_us": best_time(clip_and_pair) * 1e6,
        "vllm_desc_ids_ms": best_time(descriptor_ids) * 1e3,
        "vllm_desc_ids": len(descriptor_ids()[0]),
    }


# --------------------------------------------------------------------------- table


def run(
    models: Sequence[str], tokens: Sequence[int], vllm: SimpleNamespace | None, passes: int = 1
) -> list[dict[str, Any]]:
    """One row per (model, tokens, allocation); times are the best over ``passes`` passes of the whole table.

    Passes spread each row's measurements over minutes, so a burst of load from
    other jobs on the machine does not decide a row.
    """
    requests = [build_request(model, t, allocation) for model in models for t in tokens for allocation in ALLOCATIONS]
    if list(tokens) == list(TOKENS):  # the state hybrids at 128k, beside the full table only
        requests += [build_request(m, t, a) for m in STATE_MODELS for t in STATE_TOKENS for a in ALLOCATIONS]
    rows: list[dict[str, Any]] = []
    for index in range(passes):
        for i, req in enumerate(requests):
            row: dict[str, Any] = {
                "model": req.model,
                "tokens": req.num_tokens,
                "allocation": req.allocation,
                "groups": req.config.num_groups,
                "layers": sum(len(g.layer_names) for g in req.config.kv_cache_groups),
                "ids_in": req.ids_in,
            }
            row.update(kvspec_steps(req, baseline=index == 0))
            row["state_groups"] = sum(isinstance(g.kv_cache_spec, kvspec.MambaSpec) for g in req.config.kv_cache_groups)
            if vllm is not None and not row["state_groups"]:  # the vLLM stand-ins model attention groups only
                row.update(vllm_steps(vllm, req))
            if index == 0:
                rows.append(row)
            else:
                rows[i] = {key: min(value, row[key]) if key in TIMES else value for key, value in rows[i].items()}
            if index == passes - 1:
                print_row(rows[i], vllm is not None)
    return rows


TIMES = frozenset(
    {"clip_us", "pairs_us", "reference_us", "plan_ms", "descriptors_ms", "vllm_clip_pair_us", "vllm_desc_ids_ms"}
)


HEADER = (
    f"{'model':<13} {'tokens':>7} {'alloc':<10} {'ids in':>7} {'kept':>6} {'pairs':>6} {'descs':>6} "
    f"{'clip us':>8} {'pairs us':>8} {'ref us':>8} {'ns/id':>6} {'plan ms':>8} {'ns/page':>7} "
    f"{'desc ms':>7} {'base ms':>8}"
)


def print_row(row: dict[str, Any], with_vllm: bool) -> None:
    line = (
        f"{row['model']:<13} {row['tokens']:>7} {row['allocation']:<10} {row['ids_in']:>7} {row['ids_kept']:>6} "
        f"{row['pairs']:>6} {row['descriptors']:>6} {row['clip_us']:>8.1f} {row['pairs_us']:>8.1f} "
        f"{row['reference_us']:>8.1f} {row['reference_us'] * 1e3 / row['ids_in']:>6.1f} {row['plan_ms']:>8.2f} "
        f"{row['plan_ms'] * 1e6 / max(row['pages'], 1):>7.1f} {row['descriptors_ms']:>7.2f} "
        f"{row['plan_page_by_page_ms']:>8.1f}"
    )
    if with_vllm and "vllm_clip_pair_us" in row:
        line += (
            f" | {row['vllm_clip_pair_us']:>8.1f} {row['reference_us'] / row['vllm_clip_pair_us']:>6.0f}x"
            f" {row['vllm_desc_ids_ms']:>8.3f}"
            f" {(row['plan_ms'] + row['descriptors_ms']) / row['vllm_desc_ids_ms']:>6.1f}x"
        )
    print(line, flush=True)


def print_goals(rows: Sequence[dict[str, Any]]) -> None:
    """The issue's goals, on 128k-token Gemma 3 27B, as ratios to the goal."""
    for row in rows:
        if row["model"] != "gemma-3-27b" or row["tokens"] != 128 * 1024:
            continue
        if row["allocation"] == "shuffled":
            ref = row["reference_us"] / GOALS["reference_us"]
            print(f"goal: clip both + coverage + pairs, shuffled: {row['reference_us']:.0f} us = {ref:.2f} of 1 ms")
        goal = GOALS[f"plan_ms_{row['allocation']}"]
        print(
            f"goal: plan_transfer, {row['allocation']}: {row['plan_ms']:.2f} ms = {row['plan_ms'] / goal:.2f} of "
            f"{goal:g} ms (definition planner baseline {row['plan_page_by_page_ms']:.0f} ms, "
            f"{row['plan_page_by_page_ms'] / row['plan_ms']:.0f}x slower)"
        )


def per_group_us(row: dict[str, Any]) -> float:
    """kvspec's whole per-request cost (clip both, coverage, pairs, plan, descriptors) per KV-cache group."""
    total_us = float(row["reference_us"]) + 1e3 * (float(row["plan_ms"]) + float(row["descriptors_ms"]))
    return total_us / int(row["groups"])


def print_per_group(rows: Sequence[dict[str, Any]]) -> None:
    """Each state hybrid's per-group figure as a ratio to the sliding-window model's, same tokens and allocation."""
    base = {(r["tokens"], r["allocation"]): r for r in rows if r["model"] == PER_GROUP_BASELINE}
    for row in rows:
        ref = base.get((row["tokens"], row["allocation"]))
        if not row["state_groups"] or ref is None:
            continue
        ratio = per_group_us(row) / per_group_us(ref)
        print(
            f"per-group figure: {row['model']} ({row['groups']} groups, {row['state_groups']} state) at "
            f"{row['tokens']} tokens, {row['allocation']}: {per_group_us(row):.1f} us/group = {ratio:.2f} x "
            f"{PER_GROUP_BASELINE}'s {per_group_us(ref):.1f} us/group (target <= {PER_GROUP_TARGET})"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8k and 32k tokens only")
    parser.add_argument("--passes", type=int, default=1, help="best of this many passes over the table")
    parser.add_argument("--par-only", action="store_true", help="only the many-to-many (PAR) lines")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it is importable")
    parser.add_argument("--json", type=Path, default=None, help=f"write the rows here (docs use {DEFAULT_JSON.name})")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if args.par_only:
        print_par([par_steps(m, p, d, a) for m, p, d in PAR_CASES for a in ALLOCATIONS])
        return
    vllm = None if args.no_vllm else load_vllm()
    tokens = TOKENS[:2] if args.quick else TOKENS
    print(HEADER + (" | vllm c+p us  ratio vllm ids ms  ratio" if vllm else ""))
    rows = run(MODELS, tokens, vllm, passes=args.passes)
    print_goals(rows)
    print_per_group(rows)
    print_par([par_steps(m, p, d, a) for m, p, d in PAR_CASES for a in ALLOCATIONS])
    print(
        "ref = clip both sides + coverage + pairs, on plain lists; ns/id per id handed over (both sides); "
        "plan = plan_transfer, all layers; base = the definition's planner (compute_page_copies), once"
    )
    if args.json:
        payload = {
            "benchmark": "benchmarks/bench_engine.py",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "kvspec": kvspec.__version__,
            "vllm": None if vllm is None else vllm.version,
            "goals": GOALS,
            "note": (
                f"best of 15 rounds per step and of {args.passes} passes; {os.cpu_count()} CPUs, "
                f"load average {load:.1f} when the run started "
                "(other jobs share the machine, so absolute times are upper bounds)"
            ),
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
