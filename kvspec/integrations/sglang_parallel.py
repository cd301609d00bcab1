"""SGLang 0.5.23's mapping across TP sizes behind kvspec's parallel seam: its own slice functions, as rank copies.

:func:`plan_sglang_consumer_rank` answers :class:`kvspec.connector.ParallelConnector`
for ``--connector sglang:mooncake``. SGLang's prefill ranks push: decode rank
``d`` registers with the prefill ranks ``_resolve_rank_mapping`` names (one
when D >= P, ``P / D`` otherwise, the same ranks as PAR-4's candidates), and
each of them writes what SGLang's own functions say:

- attention: ``compute_head_slice_params`` (``common/staging_buffer.py``) gives
  the first source head, the first destination head and the head count;
  SGLang's own pages are NHD and it copies that run per token, the adapter
  lays the same heads out in the page's order (one run per token in ``nhd``,
  one run in ``hnd``);
- MLA: the latent whole, from the first registered rank only (the others get
  "dummy" requests);
- state: ``compute_mamba_state_slice_byte_blocks`` (``disaggregation/utils.py``),
  which calls ``compute_mamba_state_slice_blocks`` for a split tensor and
  ``should_send_replicated_state`` for a replicated one, with the conv
  sub-block dims SGLang's configs carry (``conv_shard_groups``: Q/K/V for GDN
  and KDA, none for standard Mamba-2) and ``outer_count`` the conv rows of an
  SD (``nhd``) conv page.

Each prefill rank frees a request after the registrations SGLang waits for,
``required_dst_info_num``: ``D / P`` when D > P, else 1 (PAR-6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.connector import ConsumerRankPlan
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, RankCopy, get_candidate_ranks, get_owned_units

__all__ = ["plan_sglang_consumer_rank"]

_DISAGG = "sglang.srt.disaggregation."
_SHARD_GROUPS = {("q", "k", "v")}
"""Conv sub-block names whose full dims SGLang's configs pass as ``conv_shard_groups`` (GDN, KDA)."""


def _import(module: str) -> Any:
    from kvspec.integrations.sglang import import_sglang

    return import_sglang(module)


def _units(tensor: PageTensor, tp: int, rank: int) -> int:
    """The rank's elements of the tensor's split axis (channels, heads): SGLang's per-rank ``dim``."""
    total = 0
    for block in tensor.sub_blocks:
        start, end = get_owned_units(block, tp_size=tp, tp_rank=rank)
        total += (end - start) * block.width
    return total


def _attention_copies(
    tensor: PageTensor, base: tuple[int, int], *, p: int, d: int, producer_tp: int, consumer_tp: int
) -> list[RankCopy]:
    """SGLang's head slice for one (prefill rank, decode rank) pair, laid out in the page's order."""
    staging = _import(_DISAGG + "common.staging_buffer")
    (heads,) = tensor.sub_blocks
    src_start, count, dst_start, _ = staging.compute_head_slice_params(producer_tp, consumer_tp, p, d, heads.extent)
    head = heads.width * tensor.element_bytes
    src_heads, dst_heads = _units(tensor, producer_tp, p), _units(tensor, consumer_tp, d)
    if tensor.order is PageOrder.NHD:
        rows = [
            (r * src_heads * head + src_start * head, r * dst_heads * head + dst_start * head, count * head)
            for r in range(tensor.rows)
        ]
    else:
        rows = [(src_start * tensor.rows * head, dst_start * tensor.rows * head, count * tensor.rows * head)]
    return [
        RankCopy(
            producer_rank=p,
            consumer_rank=d,
            producer_offset=base[0] + src,
            consumer_offset=base[1] + dst,
            nbytes=nbytes,
        )
        for src, dst, nbytes in rows
    ]


def _state_copies(page: CanonicalPage, *, p: int, d: int, producer_tp: int, consumer_tp: int) -> list[RankCopy]:
    """SGLang's slice blocks for each state tensor of one (prefill rank, decode rank) pair."""
    utils = _import(_DISAGG + "utils")
    names = tuple(b.name for b in page.tensors[0].sub_blocks)
    copies: list[RankCopy] = []
    src_base = dst_base = 0
    for index, tensor in enumerate(page.tensors):
        replicated = all(b.replicated for b in tensor.sub_blocks)
        src_len, dst_len = _rank_bytes(tensor, producer_tp, p), _rank_bytes(tensor, consumer_tp, d)
        shard_groups = (
            [b.extent * b.width for b in tensor.sub_blocks] if index == 0 and names in _SHARD_GROUPS else None
        )
        blocks = utils.compute_mamba_state_slice_byte_blocks(
            src_item_len=src_len,
            dst_item_len=dst_len,
            src_dim=0 if replicated else _units(tensor, producer_tp, p),
            dst_dim=0 if replicated else _units(tensor, consumer_tp, d),
            outer_count=tensor.rows if tensor.order is PageOrder.NHD else 1,
            src_attn_tp_size=producer_tp,
            dst_attn_tp_size=consumer_tp,
            dst_tp_rank_in_group=d,
            local_tp_rank_in_group=p,
            conv_shard_groups=shard_groups,
        )
        copies += [
            RankCopy(
                producer_rank=p,
                consumer_rank=d,
                producer_offset=src_base + src,
                consumer_offset=dst_base + dst,
                nbytes=nbytes,
            )
            for src, dst, nbytes in blocks
        ]
        src_base, dst_base = src_base + src_len, dst_base + dst_len
    return copies


def _rank_bytes(tensor: PageTensor, tp: int, rank: int) -> int:
    return tensor.rows * _units(tensor, tp, rank) * tensor.element_bytes


def _is_attention(page: CanonicalPage) -> bool:
    return all(t.token_rows for t in page.tensors)


def _check_expressible(pages: Sequence[CanonicalPage], *, producer_tp: int, consumer_tp: int) -> None:
    """What SGLang's layers and pools cannot hold: NotImplementedError (the suite skips the case)."""
    for page in pages:
        if _is_attention(page):
            for tensor in page.tensors:
                if len(tensor.sub_blocks) != 1:
                    raise NotImplementedError("SGLang slices an attention page on one axis of KV heads only")
                if tensor.order is PageOrder.OPAQUE and not tensor.sub_blocks[0].replicated:
                    # SGLang's non-MLA states other than Mamba refuse different TP (MXFP8 scales among them).
                    raise NotImplementedError("SGLang refuses different TP sizes for block-scaled (opaque) pages")
            continue
        names = tuple(b.name for b in page.tensors[0].sub_blocks)
        for block in page.tensors[0].sub_blocks:
            # SGLang's GDN / KDA configs shard every conv sub-block by TP (full_sd // tp): no replicated Q/K.
            if names in _SHARD_GROUPS and (block.extent % producer_tp or block.extent % consumer_tp):
                raise NotImplementedError(
                    f"SGLang's conv_shard_groups shard {block.name} by attention TP (full_sd // tp); "
                    f"{block.extent} units at TP {max(producer_tp, consumer_tp)} is no SGLang layout"
                )


def plan_sglang_consumer_rank(
    pages: Sequence[CanonicalPage],
    *,
    producer_tp: int,
    consumer_tp: int,
    consumer_rank: int,
    consumer_dcp: int = 1,
) -> ConsumerRankPlan:
    """What SGLang 0.5.23's prefill ranks write into decode rank ``consumer_rank``, and who frees when (PAR-3 .. PAR-6).

    Raises :class:`NotImplementedError` naming what SGLang does not support.
    """
    if consumer_dcp > 1:
        raise NotImplementedError("SGLang asserts the decode CP size is 1 (_resolve_rank_mapping)")
    _check_expressible(pages, producer_tp=producer_tp, consumer_tp=consumer_tp)
    targets = get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank)
    tp = {"producer_tp": producer_tp, "consumer_tp": consumer_tp}
    copies: list[list[RankCopy]] = []
    for page in pages:
        mine: list[RankCopy] = []
        if _is_attention(page) and all(b.replicated for t in page.tensors for b in t.sub_blocks):
            # MLA: the first registered rank sends; the others get dummy requests (_resolve_rank_mapping).
            nbytes = sum(_rank_bytes(t, consumer_tp, consumer_rank) for t in page.tensors)
            mine.append(
                RankCopy(
                    producer_rank=targets[0],
                    consumer_rank=consumer_rank,
                    producer_offset=0,
                    consumer_offset=0,
                    nbytes=nbytes,
                )
            )
        elif _is_attention(page):
            for p in targets:
                at = (0, 0)
                for tensor in page.tensors:
                    mine += _attention_copies(tensor, at, p=p, d=consumer_rank, **tp)
                    at = (
                        at[0] + _rank_bytes(tensor, producer_tp, p),
                        at[1] + _rank_bytes(tensor, consumer_tp, consumer_rank),
                    )
        else:
            for p in targets:
                mine += _state_copies(page, p=p, d=consumer_rank, **tp)
        copies.append(mine)
    # required_dst_info_num: a prefill rank sends (and frees) once D / P decode ranks registered, else one.
    count = consumer_tp // producer_tp if consumer_tp > producer_tp else 1
    return ConsumerRankPlan(copies=copies, notified=targets, completion_counts=[count] * len(targets))
