"""``kvspec guard selftest``: seeded mismatches through the guard's own verify path, each of which must be caught.

One request of ``pages`` blocks over ``layers`` layers moves from a producer of
``producer_tp`` ranks to a consumer of ``consumer_tp`` ranks. Each producer
rank digests its projection of every page (INT-2); the consumer's ranks digest
what they received, the sums are compared (:func:`kvspec.spec.check_digests`),
each rank's verdicts are agreed (:func:`kvspec.spec.agree_verdicts`) and the
mode ``fail`` fails the request (:func:`kvspec.spec.apply_guard_mode`): the same
calls a guarding connector makes. The injections:

- ``clean``: nothing injected; it must load (no false alarm);
- ``wrong_page``: one slot receives another block's page;
- ``wrong_slot``: one page lands in the next slot, which keeps what it held;
- ``stale_page``: one slot keeps the previous request's page;
- ``flipped_byte``: one byte at ``offset`` of one consumer rank's page flips;
- ``unclipped_list``: the connector moved a sliding-window list past its
  budget, caught by the rule checks (CLIP-1) before any digest.

Each injection must fail the request naming the rule and the page it
touched; the run exits non-zero otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs

from kvspec.core._errors import KVSpecError
from kvspec.core._models import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.digest import (
    DigestMode,
    DigestPolicy,
    check_digests,
    combine_digests,
    digest_planned_page,
    get_digest_plan,
    get_digest_shape,
    get_layer_prefix,
)
from kvspec.spec.guard import (
    GuardVerdict,
    agree_verdicts,
    apply_guard_mode,
    check_request_blocks,
    get_guard_verdict,
)
from kvspec.spec.parallel import CanonicalPage, get_canonical_page, get_rank_page_map

__all__ = ["INJECTIONS", "SelftestResult", "run_selftest"]

INJECTIONS = ("clean", "wrong_page", "wrong_slot", "stale_page", "flipped_byte", "unclipped_list")
"""Every case :func:`run_selftest` runs, in order; all but ``clean`` inject a mismatch."""

_BLOCK = 16
_SPEC = FullAttentionSpec(block_size=_BLOCK, num_kv_heads=8, head_size=64, dtype="bfloat16")


@attrs.frozen(kw_only=True)
class SelftestResult:
    """One case: what was injected, where, and whether the guard did what it must."""

    case: str
    expected_page: str | None
    verdict: GuardVerdict | None
    ok: bool


def _project(page: CanonicalPage, canonical: bytes, tp_size: int, tp_rank: int) -> bytes:
    runs = get_rank_page_map(page, tp_size=tp_size, tp_rank=tp_rank)
    out = bytearray(sum(r.nbytes for r in runs))
    for r in runs:
        out[r.rank_offset : r.rank_offset + r.nbytes] = canonical[r.canonical_offset : r.canonical_offset + r.nbytes]
    return bytes(out)


def _digest(
    policy: DigestPolicy,
    page: CanonicalPage,
    pages: Sequence[Sequence[bytes]],
    *,
    tp: int,
    split: int,
    granule: int,
    edit: Callable[[int, int, int, bytearray], None] | None = None,
) -> list[dict[int, int]]:
    """Per rank of one engine: the sum over layers and blocks of its digests of ``pages[layer][block]``."""
    per_rank = []
    partial = policy.partial_bytes if policy.mode is DigestMode.PARTIAL else None
    for rank in range(tp):
        plan = get_digest_plan(page, tp_size=tp, tp_rank=rank, split=split, granule=granule, partial_bytes=partial)
        found = []
        for layer, blocks in enumerate(pages):
            prefix = get_layer_prefix(f"model.layers.{layer}.self_attn")
            for block, canonical in enumerate(blocks):
                data = bytearray(_project(page, canonical, tp, rank))
                if edit is not None:
                    edit(rank, layer, block, data)
                found.append(digest_planned_page(policy.algorithm, plan, data, prefix=prefix, position=block * _BLOCK))
        per_rank.append(combine_digests(found))
    return per_rank


def _window_config() -> KVCacheConfig:
    window = SlidingWindowSpec(block_size=_BLOCK, num_kv_heads=8, head_size=64, dtype="bfloat16", sliding_window=32)
    groups, tensors = [], []
    for g, spec in enumerate((_SPEC, window)):
        name = f"model.layers.{g}.self_attn"
        groups.append(KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec))
        tensors.append(
            KVCacheTensor(
                size=64 * spec.page_size_bytes, layers=[name], layer_stride=0, block_stride=spec.page_size_bytes
            )
        )
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=tensors, kv_cache_groups=groups)


def run_selftest(
    *,
    seed: int = 0,
    producer_tp: int = 1,
    consumer_tp: int = 2,
    layers: int = 2,
    pages: int = 4,
    offset: int = 0,
    policy: DigestPolicy | None = None,
) -> list[SelftestResult]:
    """Run every case of :data:`INJECTIONS`; each result says whether the guard caught it (``clean``: loaded)."""
    policy = DigestPolicy() if policy is None else policy
    rng = random.Random(seed)
    page = get_canonical_page(_SPEC)
    split, granule = get_digest_shape(
        producer_tp=producer_tp, consumer_tp=consumer_tp, producer_block_size=_BLOCK, consumer_block_size=_BLOCK
    )
    held_pages = [[rng.randbytes(page.nbytes) for _ in range(pages)] for _ in range(layers)]
    previous = [[rng.randbytes(page.nbytes) for _ in range(pages)] for _ in range(layers)]
    layer, block = rng.randrange(layers), rng.randrange(pages - 1)
    rank = rng.randrange(consumer_tp)
    rank_bytes = sum(r.nbytes for r in get_rank_page_map(page, tp_size=consumer_tp, tp_rank=rank))
    if not 0 <= offset < rank_bytes:
        raise KVSpecError(f"offset: expected in [0, {rank_bytes}) (a consumer rank's page), got {offset}")
    held = combine_digests(_digest(policy, page, held_pages, tp=producer_tp, split=split, granule=granule))

    def received(case: str) -> list[list[bytes]]:
        got = [list(blocks) for blocks in held_pages]
        if case == "wrong_page":
            got[layer][block] = held_pages[layer][block + 1]
        elif case == "wrong_slot":
            got[layer][block + 1], got[layer][block] = held_pages[layer][block], previous[layer][block]
        elif case == "stale_page":
            got[layer][block] = previous[layer][block]
        return got

    def flip(r: int, lay: int, b: int, data: bytearray) -> None:
        if (r, lay, b) == (rank, layer, block):
            data[offset] ^= 0x01

    results = []
    for case in INJECTIONS:
        expected: str | None = f"group 0, tokens [{block * _BLOCK}, {(block + 1) * _BLOCK})"
        per_rank: list[list[GuardVerdict]] = [[] for _ in range(consumer_tp)]
        if case == "unclipped_list":
            expected = None
            try:
                check_request_blocks(
                    _window_config(),
                    TransferRequest(
                        num_tokens=4 * _BLOCK,
                        prefix_hit_tokens=0,
                        producer_block_ids=[[1, 2, 3, 4], [5, 6, 7, 8]],
                        consumer_block_ids=[[11, 12, 13, 14], [15, 16, 17]],
                    ),
                )
            except KVSpecError as exc:
                per_rank[0].append(get_guard_verdict("selftest-unclipped_list", exc))
        else:
            edit = flip if case == "flipped_byte" else None
            # Every rank gathers every rank's sums, so each compares the same totals (INT-3).
            total = combine_digests(
                _digest(policy, page, received(case), tp=consumer_tp, split=split, granule=granule, edit=edit)
            )
            for r in range(consumer_tp):
                try:
                    check_digests(f"selftest-{case}", held, total, granule=granule)
                except KVSpecError as exc:
                    per_rank[r].append(get_guard_verdict(f"selftest-{case}", exc))
        agreed = agree_verdicts(per_rank)
        failed = apply_guard_mode("fail", agreed)
        verdict = agreed[0] if agreed else None
        if case == "clean":
            ok = not failed
        elif case == "unclipped_list":
            ok = len(failed) == 1 and verdict is not None and verdict.rule == "CLIP-1"
        else:
            ok = len(failed) == 1 and verdict is not None and verdict.rule == "INT-2" and verdict.page == expected
        results.append(SelftestResult(case=case, expected_page=expected, verdict=verdict, ok=ok))
    return results
