"""vLLM's offloading scheduler against kvspec's offload reference, hook by hook, on generated requests.

Theory of operation. Each case is one call of one offload hook (store set,
hit, load set, sub-block map) with concrete inputs: a config of full and
sliding-window groups, ``f`` and ``h``, the block table vLLM's allocator
would hand over, the present map a chunk pool would hold. The cases come
from request flows (a request stores through its prefill and decode steps,
a window chunk is evicted, later requests hit and load at every residue of
``L`` mod ``f``) run on kvspec's reference, so both sides see the same
inputs; the reference's answer and ``vllm:offloading``'s are compared field
by field. Every difference is a finding, classed by rule and field; the
smallest case of each class is its reproducer. ``kvspec vllm-audit
--offload`` prints the report and writes the JSON the findings page reads.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec.core._errors import KVSpecError
from kvspec.core._models import (
    NULL_BLOCK_ID,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from kvspec.drivers._connector import OffloadConnector, ReferenceOffloadConnector
from kvspec.integrations.vllm import OffloadingConnector, installed_vllm_version
from kvspec.reference._offload import LoadSet, OffloadConfig, StoreSet

__all__ = [
    "OFFLOAD_CONNECTORS",
    "OFFLOAD_VERDICTS",
    "OffloadAuditReport",
    "OffloadCase",
    "OffloadClass",
    "OffloadShape",
    "compare_case",
    "generate_offload_cases",
    "offload_config",
    "run_offload_audit",
]

_HOOK_RULES = {"store": "OFF-3", "hit": "OFF-5", "load": "OFF-6", "sub": "OFF-7"}


@attrs.frozen(kw_only=True)
class OffloadShape:
    """One group of an audit config: full attention, a window of ``window`` tokens, or a Mamba state."""

    block_size: int
    window: int = 0
    mamba: bool = False

    def describe(self) -> str:
        """``full/B4``, ``sw8/B4`` or ``mamba/B4``."""
        if self.mamba:
            return f"mamba/B{self.block_size}"
        return f"sw{self.window}/B{self.block_size}" if self.window else f"full/B{self.block_size}"


@attrs.frozen(kw_only=True)
class OffloadCase:
    """One hook call: the config's groups, ``f``, ``h``, the hook and its inputs, and the flow it came from."""

    index: int
    flow: str
    groups: tuple[OffloadShape, ...]
    blocks_per_chunk: int
    hash_block_size: int
    hook: str
    request_id: str
    inputs: dict[str, Any] = attrs.field(eq=False)

    @property
    def rule(self) -> str:
        """The offload rule the hook implements."""
        return _HOOK_RULES[self.hook]

    def size(self) -> tuple[int, int, int]:
        """Smaller is a better reproducer: tokens, groups, index."""
        tokens = int(self.inputs.get("num_tokens", self.inputs.get("num_offloadable_tokens", 0)))
        return (tokens, len(self.groups), self.index)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: the call to paste into a reproducer."""
        return {
            "flow": self.flow,
            "groups": [g.describe() for g in self.groups],
            "blocks_per_chunk": self.blocks_per_chunk,
            "hash_block_size": self.hash_block_size,
            "hook": self.hook,
            "inputs": {k: _jsonable(v) for k, v in self.inputs.items()},
        }


def _jsonable(value: object) -> object:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


# --------------------------------------------------------------------------- configs


def offload_config(groups: Sequence[OffloadShape]) -> KVCacheConfig:
    """A small config of ``groups``, one layer each, pages of a few bytes: only block ids matter here (OFF-1)."""
    specs: list[KVCacheSpec] = []
    for g in groups:
        if g.mamba:
            specs.append(MambaSpec(block_size=g.block_size, shapes=[(2,)], dtypes=["int8"]))
        elif g.window:
            specs.append(
                SlidingWindowSpec(
                    block_size=g.block_size, num_kv_heads=1, head_size=2, dtype="int8", sliding_window=g.window
                )
            )
        else:
            specs.append(FullAttentionSpec(block_size=g.block_size, num_kv_heads=1, head_size=2, dtype="int8"))
    page = max(s.page_size_bytes for s in specs)
    names = [f"g{i}" for i in range(len(groups))]
    num_blocks = 4096
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * page, layers=[n], layer_stride=0, block_stride=page) for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[n], kv_cache_spec=s) for n, s in zip(names, specs, strict=True)],
    )


def _table(groups: Sequence[OffloadShape], tokens: int, *, first_needed: int, base: int) -> tuple[tuple[int, ...], ...]:
    """The block table vLLM's allocator hands over for ``tokens``: a window group's blocks wholly before
    ``first_needed`` (the first token the next computed token attends) are the null block (OFF-3, OFF-6)."""
    table = []
    for g, shape in enumerate(groups):
        count = -(-tokens // shape.block_size)
        skipped = max(0, first_needed - shape.window + 1) // shape.block_size if shape.window else 0
        ids = [NULL_BLOCK_ID if i < skipped else base + 1000 * g + i + 1 for i in range(count)]
        table.append(tuple(ids))
    return tuple(table)


# --------------------------------------------------------------------------- flows


_CONFIGS: tuple[tuple[str, tuple[OffloadShape, ...], tuple[int, ...]], ...] = (
    ("full+sw", (OffloadShape(block_size=4), OffloadShape(block_size=4, window=8)), (1, 3)),
    ("full+sw-unaligned", (OffloadShape(block_size=4), OffloadShape(block_size=4, window=10)), (1, 3)),
    ("full+sw-wide", (OffloadShape(block_size=4), OffloadShape(block_size=4, window=24)), (1, 2, 3)),
    ("full+sw-one-past", (OffloadShape(block_size=4), OffloadShape(block_size=4, window=13)), (1, 3)),
    ("two-block-sizes", (OffloadShape(block_size=12), OffloadShape(block_size=16)), (1,)),
    ("sizes+sw", (OffloadShape(block_size=8), OffloadShape(block_size=16, window=32)), (1,)),
    ("full+two-sw", (OffloadShape(block_size=4), OffloadShape(block_size=4, window=8),
                     OffloadShape(block_size=4, window=16)), (1, 3)),
)  # fmt: skip


class _Cases:
    """Collects hook calls as the reference runs the flows."""

    def __init__(self) -> None:
        self.cases: list[OffloadCase] = []
        self.reference = ReferenceOffloadConnector()

    def add(self, flow: str, groups: tuple[OffloadShape, ...], offload: OffloadConfig, hook: str, rid: str,
            **inputs: Any) -> None:  # fmt: skip
        self.cases.append(
            OffloadCase(
                index=len(self.cases),
                flow=flow,
                groups=groups,
                blocks_per_chunk=offload.blocks_per_chunk,
                hash_block_size=offload.hash_block_size,
                hook=hook,
                request_id=rid,
                inputs=inputs,
            )
        )


def _store_flow(
    out: _Cases, flow: str, groups: tuple[OffloadShape, ...], offload: OffloadConfig, *, prompt: int, decode: int,
    local_hit: int, rid: str,
) -> list[list[bool]]:  # fmt: skip
    """A request stores its prefill, then ``decode`` decode steps; returns the present map it leaves (OFF-3, OFF-4)."""
    config = offload_config(groups)
    present: list[list[bool]] = [[] for _ in groups]
    # A local (GPU) hit loads nothing, so vLLM offers its chunks again from chunk 0 (the manager filters
    # the ones it holds); only a load moves next_stored_chunk_idx past the hit.
    nexts = [0] * len(groups)
    steps = [prompt, *range(prompt + 1, prompt + decode + 1)]
    for o in steps:
        table = _table(groups, o, first_needed=local_hit, base=0)
        out.add(flow, groups, offload, "store", rid, block_ids=table, num_offloadable_tokens=o, next_chunk=tuple(nexts))
        store = out.reference.get_store_set(
            config, table, request_id=rid, num_offloadable_tokens=o, next_chunk=nexts, offload=offload
        )
        for g, complete in enumerate(store.complete_chunks):
            for k in complete:
                present[g] += [False] * (k + 1 - len(present[g]))
                present[g][k] = True
        nexts = list(store.next_chunks)
    return present


def _preempt_flow(
    out: _Cases, flow: str, groups: tuple[OffloadShape, ...], offload: OffloadConfig, *, prompt: int, rid: str
) -> None:
    """A request stores half its prompt, is preempted (its blocks freed), and restarts: hit, load, store (OFF-3)."""
    config = offload_config(groups)
    half = prompt // 2
    table = _table(groups, half, first_needed=0, base=0)
    out.add(
        flow, groups, offload, "store", rid, block_ids=table, num_offloadable_tokens=half, next_chunk=(0,) * len(groups)
    )
    store = out.reference.get_store_set(
        config, table, request_id=rid, num_offloadable_tokens=half, next_chunk=[0] * len(groups), offload=offload
    )
    present = [[True] * len(complete) for complete in store.complete_chunks]
    # Rescheduled: the same request id looks its own chunks up, then stores its whole prompt from chunk 0.
    _hit_and_load(out, flow, groups, offload, present, num_tokens=prompt, local_hit=0, rid=rid)
    table = _table(groups, prompt, first_needed=0, base=90_000)
    out.add(flow, groups, offload, "store", rid, block_ids=table, num_offloadable_tokens=prompt,
            next_chunk=(0,) * len(groups))  # fmt: skip


def _hit_and_load(
    out: _Cases, flow: str, groups: tuple[OffloadShape, ...], offload: OffloadConfig, present: Sequence[Sequence[bool]],
    *, num_tokens: int, local_hit: int, rid: str,
) -> None:  # fmt: skip
    """A later request of ``num_tokens`` with a local hit asks for a hit, then loads what the reference's hit needs."""
    config = offload_config(groups)
    sizes = [g.block_size * offload.blocks_per_chunk for g in groups]
    rows = tuple(tuple(row[: num_tokens // size]) + (False,) * max(0, num_tokens // size - len(row))
                 for row, size in zip(present, sizes, strict=True))  # fmt: skip
    out.add(flow, groups, offload, "hit", rid, present=rows, num_tokens=num_tokens, local_hit_tokens=local_hit)
    try:
        hit = out.reference.get_offload_hit_tokens(
            config, rows, request_id=rid, num_tokens=num_tokens, local_hit_tokens=local_hit, offload=offload
        )
    except KVSpecError:
        return
    if not hit:
        return
    t = local_hit + hit
    table = _table(groups, t, first_needed=t, base=50_000)
    out.add(flow, groups, offload, "load", rid, block_ids=table, num_tokens=t, local_hit_tokens=local_hit)


def _lcm_block(groups: Sequence[OffloadShape]) -> int:
    return math.lcm(*(g.block_size for g in groups))


def _gcd_block(groups: Sequence[OffloadShape]) -> int:
    # vLLM hashes at the gcd of the block sizes unless told otherwise (resolve_kv_cache_block_sizes).
    return math.gcd(*(g.block_size for g in groups))


def generate_offload_cases(seed: int = 0, random_requests: int = 40) -> list[OffloadCase]:
    """The audit's hook calls: fixed flows per config and ``f``, then ``random_requests`` random hits (OFF-3 ... OFF-7).

    Fixed flows per config and ``f``: a request stores its prompt and a few
    decode steps (the last chunk completes after the prompt ends); one
    window chunk is evicted; later requests hit and load with local hits at
    every residue of ``L`` mod ``f``, a partial hit (a hole in the full
    group), and a request whose local hit leaves its window's first chunk
    straddling the null prefix. Then sub-block maps at every residue.
    """
    out = _Cases()
    rng = random.Random(seed)
    for name, groups, factors in _CONFIGS:
        step = _lcm_block(groups)
        for f in factors:
            offload = OffloadConfig(blocks_per_chunk=f, hash_block_size=_gcd_block(groups))
            flow = f"{name} f={f}"
            chunk = max(g.block_size for g in groups) * f
            prompt = 6 * chunk + 1
            present = _store_flow(out, flow, groups, offload, prompt=prompt, decode=chunk, local_hit=0, rid="A")
            # Later requests: local hits at every residue of L mod f (L = C // B for full attention).
            for r in range(max(f, 2)):
                local = r * step
                _hit_and_load(out, flow + f" L%f={r % f}", groups, offload, present, num_tokens=prompt + 2,
                              local_hit=local, rid=f"B{r}")  # fmt: skip
            # A partial hit: chunk 3 of group 0 evicted.
            holed = [list(row) for row in present]
            if len(holed[0]) > 3:
                holed[0][3] = False
            _hit_and_load(out, flow + " partial", groups, offload, holed, num_tokens=prompt + 2, local_hit=0,
                          rid="C")  # fmt: skip
            # One window chunk evicted: the one just before the hit's end.
            for g, shape in enumerate(groups):
                if shape.window:
                    evicted = [list(row) for row in present]
                    last = (prompt + 1) // (shape.block_size * f) - 1
                    if 0 <= last < len(evicted[g]):
                        evicted[g][last] = False
                    _hit_and_load(out, flow + f" evict-window-g{g}", groups, offload, evicted,
                                  num_tokens=prompt + 2, local_hit=0, rid="D")  # fmt: skip
                    break
            # Straddle: a request with a local hit stores; its window's first chunks are partly null.
            if any(g.window for g in groups):
                local = 7 * step
                straddle = _store_flow(out, flow + " straddle", groups, offload, prompt=prompt + chunk, decode=0,
                                       local_hit=local, rid="E")  # fmt: skip
                _hit_and_load(out, flow + " straddle", groups, offload, straddle, num_tokens=prompt + 2,
                              local_hit=0, rid="F")  # fmt: skip
            # Preempted mid-store: half the prompt stored, the blocks freed, the request rescheduled with a
            # new table; it looks up its own stored chunks and stores again from chunk 0.
            _preempt_flow(out, flow + " preempted", groups, offload, prompt=prompt, rid="P")
            for first in range(2 * f):
                out.add(flow, groups, offload, "sub", "S", first_block_index=first, num_blocks=f + 1)
    # Random requests over the same configs: random present maps, request sizes and local hits.
    for i in range(random_requests):
        name, groups, factors = rng.choice(_CONFIGS)
        f = rng.choice(factors)
        offload = OffloadConfig(blocks_per_chunk=f, hash_block_size=_gcd_block(groups))
        sizes = [g.block_size * f for g in groups]
        n = rng.randint(1, 12 * max(sizes))
        present = [[rng.random() < 0.8 for _ in range(n // size)] for size in sizes]
        local = rng.randint(0, n // _lcm_block(groups)) * _lcm_block(groups)
        local = min(local, (n - 1) // _lcm_block(groups) * _lcm_block(groups))
        _hit_and_load(out, f"random {name} f={f}", groups, offload, present, num_tokens=n, local_hit=local,
                      rid=f"R{i}")  # fmt: skip
    mamba = (OffloadShape(block_size=4), OffloadShape(block_size=4, mamba=True))
    offload = OffloadConfig(blocks_per_chunk=1, hash_block_size=4)
    out.add("full+mamba f=1", mamba, offload, "hit", "M", present=((True,) * 4, (True,) * 4), num_tokens=17,
            local_hit_tokens=0)  # fmt: skip
    return out.cases


# --------------------------------------------------------------------------- comparing


def _call(connector: OffloadConnector, case: OffloadCase) -> object:
    config = offload_config(case.groups)
    offload = OffloadConfig(blocks_per_chunk=case.blocks_per_chunk, hash_block_size=case.hash_block_size)
    i = case.inputs
    if case.hook == "store":
        return connector.get_store_set(
            config, i["block_ids"], request_id=case.request_id, num_offloadable_tokens=i["num_offloadable_tokens"],
            next_chunk=i["next_chunk"], offload=offload,
        )  # fmt: skip
    if case.hook == "hit":
        return connector.get_offload_hit_tokens(
            config, i["present"], request_id=case.request_id, num_tokens=i["num_tokens"],
            local_hit_tokens=i["local_hit_tokens"], offload=offload,
        )  # fmt: skip
    if case.hook == "load":
        return connector.get_load_set(
            config, i["block_ids"], request_id=case.request_id, num_tokens=i["num_tokens"],
            local_hit_tokens=i["local_hit_tokens"], offload=offload,
        )  # fmt: skip
    return connector.map_sub_blocks(i["first_block_index"], i["num_blocks"], blocks_per_chunk=case.blocks_per_chunk)


def _fields(result: object) -> dict[str, object]:
    """The fields compared: a set's chunks, blocks, first positions (where it has blocks), counts, next chunks."""
    if isinstance(result, (StoreSet, LoadSet)):
        fields: dict[str, object] = {
            "chunks": [list(c) for c in result.chunks],
            "block_ids": [list(b) for b in result.block_ids],
            "first_block_indices": [f if n else None for f, n in zip(result.first_block_indices, result.num_blocks,
                                                                      strict=True)],
            "num_blocks": list(result.num_blocks),
        }  # fmt: skip
        if isinstance(result, StoreSet):
            fields["next_chunks"] = list(result.next_chunks)
        return fields
    if isinstance(result, tuple):
        return {"sub_blocks": [list(p) for p in result]}
    return {"hit": result}


def _outcome(connector: OffloadConnector, case: OffloadCase) -> tuple[object, dict[str, object]]:
    """The hook's result and its compared fields, or None and the error's name and first line."""
    try:
        result = _call(connector, case)
    except KVSpecError as exc:
        return None, {"error": type(exc).__name__, "message": str(exc).splitlines()[0][:300]}
    return result, _fields(result)


def _store_class(case: OffloadCase, mine: StoreSet, reference: StoreSet) -> str | None:
    """Name a store-set difference where vLLM offers a subset of kvspec's chunks (OFF-3, OFF-4)."""
    dropped_partial = dropped_window = False
    for g, (theirs, ours, partial) in enumerate(zip(mine.chunks, reference.chunks, reference.partial_chunks,
                                                     strict=True)):  # fmt: skip
        if not set(theirs) <= set(ours):
            return None
        dropped = set(ours) - set(theirs)
        dropped_partial |= bool(dropped & set(partial))
        dropped_window |= bool(dropped - set(partial)) and bool(case.groups[g].window)
        if dropped - set(partial) and not case.groups[g].window:
            return None
    if dropped_window:
        return "OFF-3:stores-window-tail-only"
    if dropped_partial:
        return "OFF-3:skips-partial-chunk"
    return None


def compare_case(case: OffloadCase, connector: OffloadConnector) -> list[tuple[str, dict[str, object]]]:
    """The differences of ``connector``'s answer from the reference's: (class id, detail) (OFF-3 ... OFF-7).

    A class id is ``RULE:what``: ``OFF-3:stores-window-tail-only`` and
    ``OFF-3:skips-partial-chunk`` when vLLM offers a subset of the
    reference's chunks, ``OFF-5:vllm-hit-shorter`` or ``-longer`` for a hit,
    else ``RULE:field`` for the first differing field, or ``RULE:refuses`` /
    ``RULE:kvspec-refuses`` when only one side raised.
    """
    mine, mine_fields = _outcome(connector, case)
    reference, reference_fields = _outcome(ReferenceOffloadConnector(), case)
    detail: dict[str, object] = {"vllm": mine_fields, "kvspec": reference_fields}
    if mine is None or reference is None:
        if mine is None and reference is None:
            return []
        return [(f"{case.rule}:{'refuses' if mine is None else 'kvspec-refuses'}", detail)]
    differing = [name for name in reference_fields if mine_fields.get(name) != reference_fields[name]]
    if not differing:
        return []
    detail = {
        "vllm": {n: mine_fields[n] for n in differing},
        "kvspec": {n: reference_fields[n] for n in differing},
    }
    named = (
        _store_class(case, mine, reference) if isinstance(mine, StoreSet) and isinstance(reference, StoreSet) else None
    )
    if isinstance(mine, int) and isinstance(reference, int):
        named = f"{case.rule}:vllm-hit-{'shorter' if mine < reference else 'longer'}"
    return [(named or f"{case.rule}:{differing[0]}", detail)]


# --------------------------------------------------------------------------- verdicts

OFFLOAD_VERDICTS: dict[str, tuple[str, str]] = {
    "OFF-3:stores-window-tail-only": (
        "kvspec rule gap",
        "vLLM's default prefix_cache_retention_interval=0 stores, in a window group, only the chunks a hit at "
        "the prompt's replay boundary (N - 1) reads (reachable_block_mask); OFF-3 stores every complete chunk. "
        "Fewer hits, never wrong KV: OFF-3's MUST is stricter than safety needs (decision 56 in decisions-offload.md).",
    ),
    "OFF-3:skips-partial-chunk": (
        "accepted difference",
        "vLLM 0.33.0 skips a chunk with a null sub-block; OFF-3 writes its real sub-blocks and OFF-4 never "
        "reports it present. Neither lets a load read an unwritten sub-block (decision 57 in decisions-offload.md).",
    ),
    "OFF-5:vllm-hit-shorter": (
        "accepted difference",
        "A window group with W = 1 (mod C_g): vLLM asks for cdiv(W, C_g) present chunks before the hit's end where "
        "the cdiv(W - 1, C_g) the recomputed token attends suffice (offload-and-vllm.md); a shorter hit, "
        "never a wrong one.",
    ),
    "OFF-5:kvspec-refuses": (
        "accepted difference",
        "vLLM admits a Mamba group as a one-chunk window; OFF-9 fails closed (decisions-offload.md).",
    ),
}
"""Class id -> (verdict, why): ``vLLM bug``, ``kvspec rule gap`` or ``accepted difference``; the findings page."""


# --------------------------------------------------------------------------- the report


OFFLOAD_CONNECTORS: dict[str, Callable[[], OffloadConnector]] = {
    "offloading": OffloadingConnector,
    "offloading-dense": lambda: OffloadingConnector(retention_interval=None),
}
"""Adapters the audit drives: ``vllm:offloading`` as shipped (vLLM's default retention of window chunks, 0), and
with ``prefix_cache_retention_interval=None`` (a window tail at every chunk boundary)."""


@attrs.frozen(kw_only=True)
class OffloadClass:
    """One class of disagreement on one adapter: how many hook calls, from which flows, the smallest reproducer."""

    connector: str
    id: str
    cases: int
    flows: tuple[str, ...]
    reproducer: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, with the verdict recorded for the class."""
        verdict, why = OFFLOAD_VERDICTS.get(self.id, ("unclassified", ""))
        return {
            "connector": self.connector,
            "class": self.id,
            "rule": self.id.partition(":")[0],
            "cases": self.cases,
            "flows": list(self.flows),
            "verdict": verdict,
            "why": why,
            "reproducer": self.reproducer,
        }


@attrs.frozen(kw_only=True)
class OffloadAuditReport:
    """What ``kvspec vllm-audit --offload`` found: per adapter and rule, hook calls and agreements; each class."""

    seed: int
    random_requests: int
    vllm_version: str
    calls: dict[str, dict[str, int]]
    agreed: dict[str, dict[str, int]]
    classes: tuple[OffloadClass, ...]
    seconds: float

    def to_dict(self) -> dict[str, object]:
        """The committed JSON's content (``seconds`` left out, so a rerun at the same seed matches)."""
        return {
            "vllm_version": self.vllm_version,
            "seed": self.seed,
            "random_requests": self.random_requests,
            "calls": self.calls,
            "agreed": self.agreed,
            "classes": [c.to_dict() for c in self.classes],
        }

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def render(self) -> str:
        """The terminal table, then each class's smallest reproducer."""
        lines = [f"kvspec vllm-audit --offload: vLLM {self.vllm_version}, seed {self.seed}, {self.seconds:.1f}s", ""]
        header = f"{'connector':<18} {'rule':<7} {'hook calls':>10} {'agree':>6}"
        lines += [header, "-" * len(header)]
        for connector, per_rule in self.calls.items():
            for rule, count in per_rule.items():
                lines.append(f"{connector:<18} {rule:<7} {count:>10} {self.agreed[connector][rule]:>6}")
        for c in self.classes:
            verdict = OFFLOAD_VERDICTS.get(c.id, ("unclassified", ""))[0]
            r = c.reproducer
            lines += [
                "",
                f"{c.connector} {c.id}: {c.cases} calls, {verdict}",
                f"  {r['flow']}: {r['groups']} f={r['blocks_per_chunk']} h={r['hash_block_size']} {r['hook']}",
                f"  inputs {json.dumps(r['inputs'])}",
                f"  vllm   {json.dumps(r['vllm'])}",
                f"  kvspec {json.dumps(r['kvspec'])}",
            ]
        return "\n".join(lines) + "\n"


def run_offload_audit(
    *,
    seed: int = 0,
    random_requests: int = 200,
    connectors: dict[str, Callable[[], OffloadConnector]] | None = None,
) -> OffloadAuditReport:
    """Every generated hook call through each adapter and the reference; classify each difference (OFF-3 ... OFF-7).

    ``connectors`` maps a name to a factory (default
    :data:`OFFLOAD_CONNECTORS`); a test plants a mutant here.
    """
    started = time.perf_counter()
    factories = OFFLOAD_CONNECTORS if connectors is None else connectors
    cases = generate_offload_cases(seed, random_requests)
    calls: dict[str, dict[str, int]] = {}
    agreed: dict[str, dict[str, int]] = {}
    classes = []
    for name, factory in factories.items():
        connector = factory()
        calls[name] = {rule: 0 for rule in _HOOK_RULES.values()}
        agreed[name] = dict(calls[name])
        found: dict[str, list[tuple[OffloadCase, dict[str, object]]]] = {}
        for case in cases:
            calls[name][case.rule] += 1
            differences = compare_case(case, connector)
            agreed[name][case.rule] += not differences
            for class_id, detail in differences:
                found.setdefault(class_id, []).append((case, detail))
        for class_id in sorted(found):
            hits = found[class_id]
            case, detail = min(hits, key=lambda h: h[0].size())
            classes.append(
                OffloadClass(
                    connector=name,
                    id=class_id,
                    cases=len(hits),
                    flows=tuple(sorted({h[0].flow for h in hits}))[:8],
                    reproducer={**case.to_dict(), **detail},
                )
            )
    return OffloadAuditReport(
        seed=seed,
        random_requests=random_requests,
        vllm_version=installed_vllm_version() or "not installed",
        calls=calls,
        agreed=agreed,
        classes=tuple(classes),
        seconds=time.perf_counter() - started,
    )
