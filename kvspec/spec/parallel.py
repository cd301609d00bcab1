"""Many ranks, one canonical page: which bytes each rank holds and which it reads from whom, PAR-1 .. PAR-8.

An engine is a set of ranks: TP ranks split heads and channels, PP stages hold
bands of layers, DCP ranks hold interleaved tokens, DP ranks are separate
engines. The *canonical page* is the parallelism-free content of one block of
one layer (all heads, all channels, all tokens of the block); every rank's
physical page is a projection of it. The rules below say which slice a rank
owns (PAR-1), where it lies in its page (PAR-2), that what a consumer rank
receives tiles its page exactly once (PAR-3) from one elected source (PAR-4),
which layouts can be sliced (PAR-5), how many notifications free a producer's
blocks (PAR-6), that layers pair by name across stages (PAR-7), where a
DCP rank's tokens sit (PAR-8), and which two ranks' layouts the handshake
admits (PAR-9) (docs/spec/parallelism.md).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvspec.core._errors import ParallelismError
from kvspec.core._models import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec

__all__ = [
    "ByteRun",
    "CanonicalPage",
    "PageOrder",
    "PageTensor",
    "ParallelLayout",
    "RankCopy",
    "RankLayout",
    "StagePair",
    "SubBlock",
    "check_coverage",
    "check_page_sliceable",
    "check_tp_pair",
    "compute_dcp_copies",
    "compute_rank_copies",
    "elect_source_rank",
    "get_candidate_ranks",
    "get_canonical_page",
    "get_completion_count",
    "get_dcp_owner",
    "get_dcp_token_position",
    "get_layout_mismatch",
    "get_owned_units",
    "get_rank_page_map",
    "pair_stage_layers",
]


# --------------------------------------------------------------------------- models


class PageOrder(str, enum.Enum):
    """How a tensor of a page orders its split axis (heads, channels) against its rows (tokens, kernel taps) (PAR-5).

    ``hnd``: the split axis outermost, so a rank's slice of a sub-block is one
    contiguous run: attention HND (vLLM's block-contiguous page), a conv state
    in DS layout (dim, kernel - 1). ``nhd``: rows outermost, a slice is one run
    per row: attention NHD (SGLang's per-token head slices), conv SD. ``opaque``:
    no axis can be addressed (NVFP4 or MXFP8 pages with interleaved scales): the
    tensor moves whole or not at all.
    """

    HND = "hnd"
    NHD = "nhd"
    OPAQUE = "opaque"


def _positive(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ParallelismError(f"{type(inst).__name__}.{attribute.name}: expected a positive int, got {value!r}")


def _non_negative(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ParallelismError(f"{type(inst).__name__}.{attribute.name}: expected a non-negative int, got {value!r}")


def _name(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ParallelismError(f"{type(inst).__name__}.{attribute.name}: expected a non-empty str, got {value!r}")


def _to_order(value: object) -> PageOrder:
    try:
        return PageOrder(value)
    except ValueError:
        raise ParallelismError(
            f"PageTensor.order: expected one of {[o.value for o in PageOrder]}, got {value!r}"
        ) from None


def _to_layers(value: Iterable[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)  # a bare name is one layer, not its characters


@attrs.frozen(kw_only=True)
class SubBlock:
    """One sub-block of a tensor's split axis: KV heads, a conv sub-projection (x, B, C or Q, K, V), SSM heads.

    ``extent`` is its global size in shard units (heads, groups, channels),
    ``width`` the elements of the axis per unit (``head_dim`` channels of a conv
    x unit, ``d_state`` of a B group; 1 for attention heads, whose size is the
    tensor's ``element_bytes``). ``replicated`` sub-blocks are held whole by
    every rank (the MLA latent, a PLE state); the others are split (PAR-1).
    """

    name: str = attrs.field(validator=_name)
    extent: int = attrs.field(validator=_positive)
    width: int = attrs.field(default=1, validator=_positive)
    replicated: bool = False


def _to_sub_blocks(value: Iterable[SubBlock]) -> tuple[SubBlock, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class PageTensor:
    """One tensor of a canonical page: its split axis as sub-blocks, its rows, its element size and order.

    ``rows`` is the other axis: the block's tokens for attention
    (``token_rows``: DCP splits them, PAR-8), the kernel taps of a conv state,
    1 for an SSM state. ``element_bytes`` is one element of the split axis in
    one row (``head_size * itemsize`` for attention, ``itemsize`` for a conv
    channel, ``head_dim * d_state * itemsize`` for an SSM head).
    """

    name: str = attrs.field(validator=_name)
    sub_blocks: tuple[SubBlock, ...] = attrs.field(converter=_to_sub_blocks)
    rows: int = attrs.field(validator=_positive)
    element_bytes: int = attrs.field(validator=_positive)
    order: PageOrder = attrs.field(default=PageOrder.HND, converter=_to_order)
    token_rows: bool = False

    @sub_blocks.validator
    def _check_sub_blocks(self, attribute: attrs.Attribute[Any], value: tuple[SubBlock, ...]) -> None:
        if not value or not all(isinstance(b, SubBlock) for b in value):
            raise ParallelismError(f"PageTensor.sub_blocks: expected at least one SubBlock, got {value!r}")


def _to_tensors(value: Iterable[PageTensor]) -> tuple[PageTensor, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class CanonicalPage:
    """The parallelism-free content of one block of one layer: its tensors, global extents, back to back (PAR-2).

    A rank's physical page holds the same tensors in the same order with its
    own extents (PAR-1), back to back from the page's start; bytes after them
    are padding and never move (PLAN-1).
    """

    tensors: tuple[PageTensor, ...] = attrs.field(converter=_to_tensors)

    @tensors.validator
    def _check_tensors(self, attribute: attrs.Attribute[Any], value: tuple[PageTensor, ...]) -> None:
        if not value or not all(isinstance(t, PageTensor) for t in value):
            raise ParallelismError(f"CanonicalPage.tensors: expected at least one PageTensor, got {value!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of the canonical page."""
        return sum(t.rows * t.element_bytes * sum(b.extent * b.width for b in t.sub_blocks) for t in self.tensors)


@attrs.frozen(kw_only=True)
class RankLayout:
    """Where one rank of an engine stands: its TP rank, the layers its PP stage holds, its DCP rank; DP routes only.

    ``layers`` empty means every layer (no PP). ``dp_rank`` picks the engine a
    request goes to and changes no byte map (PAR-7, PAR-8).
    """

    tp_size: int = attrs.field(default=1, validator=_positive)
    tp_rank: int = attrs.field(default=0, validator=_non_negative)
    layers: tuple[str, ...] = attrs.field(default=(), converter=_to_layers)
    dcp_size: int = attrs.field(default=1, validator=_positive)
    dcp_rank: int = attrs.field(default=0, validator=_non_negative)
    dcp_interleave: int = attrs.field(default=1, validator=_positive)
    dp_rank: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ParallelismError(f"RankLayout.tp_rank: expected below tp_size {self.tp_size}, got {self.tp_rank}")
        if self.dcp_rank >= self.dcp_size:
            raise ParallelismError(f"RankLayout.dcp_rank: expected below dcp_size {self.dcp_size}, got {self.dcp_rank}")


def _to_pages(value: Iterable[CanonicalPage]) -> tuple[CanonicalPage, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ParallelLayout:
    """One rank's parallel layout as its engine descriptor carries it (protocol 1.3) (PAR-9).

    ``rank`` is where the rank stands (TP, its PP stage's layers, DCP);
    ``pages`` holds one canonical page per KV-cache group, in group order:
    each tensor's sub-blocks (global extent, split or replicated) and the
    order of the rank's own pages (``hnd``, ``nhd``, ``opaque``) (PAR-9).
    """

    rank: RankLayout = attrs.field(validator=attrs.validators.instance_of(RankLayout))
    pages: tuple[CanonicalPage, ...] = attrs.field(converter=_to_pages)

    @pages.validator
    def _check_pages(self, attribute: attrs.Attribute[Any], value: tuple[CanonicalPage, ...]) -> None:
        if not value or not all(isinstance(p, CanonicalPage) for p in value):
            raise ParallelismError(f"ParallelLayout.pages: expected at least one CanonicalPage, got {value!r}")


@attrs.frozen(kw_only=True)
class ByteRun:
    """``nbytes`` at ``rank_offset`` of a rank's page hold the canonical bytes at ``canonical_offset`` (PAR-2)."""

    rank_offset: int
    canonical_offset: int
    nbytes: int


@attrs.frozen(kw_only=True)
class RankCopy:
    """One contiguous copy from a producer rank's page to a consumer rank's page (offsets within the page) (PAR-3).

    ``producer_page`` says which of the producer's pages of the canonical block
    it reads: always 0, except for a consumer with DCP, whose canonical block
    spans ``dcp_size`` producer pages (PAR-8).
    """

    producer_rank: int
    producer_page: int = 0
    consumer_rank: int
    producer_offset: int
    consumer_offset: int
    nbytes: int


@attrs.frozen(kw_only=True)
class StagePair:
    """The layers a producer PP stage gives a consumer stage, in the consumer stage's order (PAR-7)."""

    producer_stage: int
    consumer_stage: int
    layers: tuple[str, ...]


def _to_block_lists(value: Iterable[Iterable[SubBlock]]) -> tuple[tuple[SubBlock, ...], ...]:
    return tuple(tuple(blocks) for blocks in value)


def get_canonical_page(
    spec: KVCacheSpec, *, state_blocks: Sequence[Sequence[SubBlock]] = (), order: PageOrder = PageOrder.HND
) -> CanonicalPage:
    """The canonical page of one block of one layer of a group whose spec is ``spec``, at TP 1 (PAR-2).

    Attention: K then V, each ``num_kv_heads`` heads (split) over the block's
    tokens in ``order``. MLA: one latent, replicated. A state group: its
    tensors in order, each split on its first axis into ``state_blocks[i]``
    (conv x/B/C or Q/K/V; SSM heads), whose units must add up to that axis; a
    conv state in ``SD`` layout splits its last axis, one run per kernel tap (PAR-2).
    """
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        latent = SubBlock(name="latent", extent=spec.num_kv_heads, replicated=True)
        element = spec.head_size * spec.dtype.itemsize
        return CanonicalPage(
            tensors=[
                PageTensor(
                    name="latent",
                    sub_blocks=[latent],
                    rows=spec.block_size,
                    element_bytes=element,
                    order=order,
                    token_rows=True,
                )
            ]
        )
    if isinstance(spec, AttentionSpec):
        heads = SubBlock(name="kv_heads", extent=spec.num_kv_heads)
        tensors = [
            PageTensor(
                name=name,
                sub_blocks=[heads],
                rows=spec.block_size,
                element_bytes=size * spec.dtype.itemsize,
                order=order,
                token_rows=True,
            )
            for name, size in (("k", spec.head_size), ("v", spec.value_head_size))
        ]
        return CanonicalPage(tensors=tensors)
    if not isinstance(spec, MambaSpec):
        raise ParallelismError(f"spec: expected an attention or state spec, got {type(spec).__name__} (PAR-2)")
    blocks = _to_block_lists(state_blocks)
    # Which units make up each state tensor's split axis is the model's, not the spec's: it must be given (PAR-2).
    if len(blocks) != len(spec.shapes):
        raise ParallelismError(
            f"state_blocks: expected {len(spec.shapes)} sub-block lists (one per state tensor), got {len(blocks)} "
            "(PAR-2)"
        )
    tensors = []
    for i, (shape, dtype, parts) in enumerate(zip(spec.shapes, spec.dtypes, blocks, strict=True)):
        state_first = i == 0 and spec.conv_layout == "SD"
        axis = shape[-1] if state_first else shape[0]
        rest = 1
        for size in shape[:-1] if state_first else shape[1:]:
            rest *= size
        if sum(b.extent * b.width for b in parts) != axis:
            raise ParallelismError(
                f"state_blocks[{i}]: expected units adding up to the split axis {axis}, "
                f"got {sum(b.extent * b.width for b in parts)} (PAR-2)"
            )
        tensors.append(
            PageTensor(
                name=f"state[{i}]",
                sub_blocks=parts,
                rows=rest if state_first else 1,
                element_bytes=dtype.itemsize if state_first else rest * dtype.itemsize,
                order=PageOrder.NHD if state_first else PageOrder.HND,
            )
        )
    return CanonicalPage(tensors=tensors)


# --------------------------------------------------------------------------- PAR-1 ownership


def get_owned_units(block: SubBlock, *, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The units ``[start, end)`` of a sub-block that TP rank ``tp_rank`` of ``tp_size`` holds (PAR-1).

    Replicated: all of them. Split, ``E = extent`` units over ``T = tp_size``
    ranks: ``[r*E/T, (r+1)*E/T)`` when T divides E; when E divides T, each unit
    is held by T/E ranks and rank r holds unit ``r*E/T`` (rounded down): GQA
    replicas of KV heads, B/C groups when ``n_groups < T``. Any other pair of
    sizes is refused by name (PAR-1).
    """
    # A rank outside its engine holds nothing: never a slice computed past the last rank (PAR-1).
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ParallelismError(f"tp_rank: expected in [0, {tp_size}) with tp_size positive, got {tp_rank} (PAR-1)")
    if block.replicated:
        return 0, block.extent
    if block.extent % tp_size == 0:
        per_rank = block.extent // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % block.extent == 0:
        unit = tp_rank * block.extent // tp_size
        return unit, unit + 1
    raise ParallelismError(
        f"{block.name}.extent: expected a multiple or a divisor of tp_size {tp_size}, got {block.extent} (PAR-1)"
    )


def _local_extent(block: SubBlock, tp_size: int, tp_rank: int) -> int:
    start, end = get_owned_units(block, tp_size=tp_size, tp_rank=tp_rank)
    return end - start


# --------------------------------------------------------------------------- PAR-2 the canonical page


def get_rank_page_map(page: CanonicalPage, *, tp_size: int, tp_rank: int) -> tuple[ByteRun, ...]:
    """Which bytes of a rank's physical page hold which canonical bytes, in page order (PAR-2).

    Tensors lie back to back in both pages, each with its sub-blocks in order.
    In ``hnd`` (and ``opaque``) order a sub-block is ``extent`` units of
    ``rows * width * element_bytes`` bytes each, so a rank's units are one run;
    in ``nhd`` order each row holds every sub-block's units, so a rank's slice is
    one run per row. Together the runs cover the rank's page exactly (PAR-2).
    """
    runs: list[ByteRun] = []
    rank_base = canonical_base = 0
    for tensor in page.tensors:
        owned = [get_owned_units(b, tp_size=tp_size, tp_rank=tp_rank) for b in tensor.sub_blocks]
        unit_bytes = [b.width * tensor.element_bytes for b in tensor.sub_blocks]
        canonical_row = sum(b.extent * u for b, u in zip(tensor.sub_blocks, unit_bytes, strict=True))
        rank_row = sum((end - start) * u for (start, end), u in zip(owned, unit_bytes, strict=True))
        if tensor.order is PageOrder.NHD:
            for row in range(tensor.rows):
                rank_at, canonical_at = rank_base + row * rank_row, canonical_base + row * canonical_row
                for block, (start, end), unit in zip(tensor.sub_blocks, owned, unit_bytes, strict=True):
                    runs.append(
                        ByteRun(
                            rank_offset=rank_at,
                            canonical_offset=canonical_at + start * unit,
                            nbytes=(end - start) * unit,
                        )
                    )
                    rank_at += (end - start) * unit
                    canonical_at += block.extent * unit
        else:
            rank_at, canonical_at = rank_base, canonical_base
            for block, (start, end), unit in zip(tensor.sub_blocks, owned, unit_bytes, strict=True):
                runs.append(
                    ByteRun(
                        rank_offset=rank_at,
                        canonical_offset=canonical_at + start * tensor.rows * unit,
                        nbytes=(end - start) * tensor.rows * unit,
                    )
                )
                rank_at += (end - start) * tensor.rows * unit
                canonical_at += block.extent * tensor.rows * unit
        rank_base += tensor.rows * rank_row
        canonical_base += tensor.rows * canonical_row
    return tuple(runs)


# --------------------------------------------------------------------------- PAR-3 coverage


def _to_canonical(runs: Sequence[ByteRun], offset: int, nbytes: int, where: str) -> list[tuple[int, int]]:
    """The canonical ``(offset, nbytes)`` pieces a range of a rank's page holds, merged where they go on."""
    pieces: list[tuple[int, int]] = []
    at, end = offset, offset + nbytes
    # Runs lie in page order (PAR-2): start at the last one beginning at or before ``offset``.
    first = max(0, bisect.bisect_right(runs, offset, key=lambda run: run.rank_offset) - 1)
    for run in itertools.islice(runs, first, None):
        if run.rank_offset <= at < run.rank_offset + run.nbytes:
            take = min(end, run.rank_offset + run.nbytes) - at
            canonical = run.canonical_offset + at - run.rank_offset
            if pieces and pieces[-1][0] + pieces[-1][1] == canonical:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + take)
            else:
                pieces.append((canonical, take))
            at += take
            if at == end:
                return pieces
    # A byte outside every run is outside the rank's tensors: padding or another allocation (PAR-3).
    raise ParallelismError(f"{where}: byte {at} holds no canonical byte of the page (PAR-3)")


def check_coverage(
    page: CanonicalPage, *, producer_tp: int, consumer_tp: int, consumer_rank: int, copies: Sequence[RankCopy]
) -> None:
    """Raise :class:`ParallelismError` unless ``copies`` fill consumer rank ``consumer_rank`` exactly (PAR-3).

    Each copy must read, in its producer rank's page, the same canonical bytes
    that it writes in the consumer rank's page (no byte from another tensor,
    sub-block or head, none from padding); and the copies landing in the
    consumer rank must tile its page's tensors exactly once: no gap, no overlap (PAR-3).
    """
    consumer_runs = get_rank_page_map(page, tp_size=consumer_tp, tp_rank=consumer_rank)
    producer_maps: dict[int, tuple[ByteRun, ...]] = {}
    landed: list[tuple[int, int]] = []
    for i, copy in enumerate(copies):
        where = f"copies[{i}]"
        if copy.nbytes <= 0 or copy.producer_offset < 0 or copy.consumer_offset < 0:
            raise ParallelismError(f"{where}: expected a positive size at non-negative offsets, got {copy!r} (PAR-3)")
        if copy.consumer_rank != consumer_rank:
            raise ParallelismError(f"{where}.consumer_rank: expected {consumer_rank}, got {copy.consumer_rank} (PAR-3)")
        # One canonical page is one producer page; a DCP consumer's copies are checked per token (PAR-8).
        if copy.producer_page != 0:
            raise ParallelismError(f"{where}.producer_page: expected 0 without DCP, got {copy.producer_page} (PAR-3)")
        if not 0 <= copy.producer_rank < producer_tp:
            raise ParallelismError(f"{where}.producer_rank: expected in [0, {producer_tp}), got {copy.producer_rank}")
        if copy.producer_rank not in producer_maps:
            producer_maps[copy.producer_rank] = get_rank_page_map(page, tp_size=producer_tp, tp_rank=copy.producer_rank)
        read = _to_canonical(producer_maps[copy.producer_rank], copy.producer_offset, copy.nbytes, f"{where} producer")
        written = _to_canonical(consumer_runs, copy.consumer_offset, copy.nbytes, f"{where} consumer")
        # The bytes read must be the very canonical bytes the consumer keeps there (PAR-3, #55208).
        if read != written:
            raise ParallelismError(
                f"{where}: reads canonical bytes {read} of producer rank {copy.producer_rank} into the place of "
                f"canonical bytes {written} of consumer rank {consumer_rank} (PAR-3)"
            )
        landed.append((copy.consumer_offset, copy.nbytes))
    page_end = sum(run.nbytes for run in consumer_runs)
    at = 0
    for offset, nbytes in sorted(landed):
        # Sorted by offset, each copy must start where the previous one ended (PAR-3).
        if offset != at:
            problem = "overlap" if offset < at else "gap"
            raise ParallelismError(f"consumer rank {consumer_rank}: {problem} at byte {min(offset, at)} (PAR-3)")
        at += nbytes
    if at != page_end:
        raise ParallelismError(f"consumer rank {consumer_rank}: gap at byte {at}; page ends at {page_end} (PAR-3)")


# --------------------------------------------------------------------------- PAR-4 writer election


def check_tp_pair(*, producer_tp: int, consumer_tp: int) -> None:
    """Raise :class:`ParallelismError` unless one TP size divides the other (PAR-4)."""
    if producer_tp <= 0 or consumer_tp <= 0 or (producer_tp % consumer_tp and consumer_tp % producer_tp):
        raise ParallelismError(
            f"consumer_tp: expected a multiple or a divisor of producer_tp {producer_tp}, got {consumer_tp} (PAR-4)"
        )


def get_candidate_ranks(*, producer_tp: int, consumer_tp: int, consumer_rank: int) -> tuple[int, ...]:
    """The producer ranks aligned with a consumer rank, in order: it reads from and notifies these only (PAR-4).

    With ``P >= D`` (P producer ranks, D consumer ranks), consumer rank c
    faces ``m = P / D`` ranks ``c*m .. c*m + m - 1``; with ``P < D`` the one
    rank ``c * P / D`` (rounded down) (PAR-4).
    """
    check_tp_pair(producer_tp=producer_tp, consumer_tp=consumer_tp)
    if producer_tp >= consumer_tp:
        ratio = producer_tp // consumer_tp
        return tuple(range(consumer_rank * ratio, (consumer_rank + 1) * ratio))
    return (consumer_rank * producer_tp // consumer_tp,)


def elect_source_rank(block: SubBlock, unit: int, *, producer_tp: int, consumer_tp: int, consumer_rank: int) -> int:
    """The one producer rank a consumer rank reads ``unit`` of ``block`` from: the first candidate holding it (PAR-4).

    A replicated unit (GQA replicas, the MLA latent, B/C with ``n_groups < TP``)
    sits on several producer ranks; exactly one writes each destination (PAR-4).
    """
    for rank in get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank):
        start, end = get_owned_units(block, tp_size=producer_tp, tp_rank=rank)
        if start <= unit < end:
            return rank
    raise ParallelismError(
        f"{block.name}: no producer rank aligned with consumer rank {consumer_rank} holds unit {unit} (PAR-4)"
    )


def _get_source_runs(
    block: SubBlock, start: int, end: int, candidates: Sequence[int], *, producer_tp: int
) -> list[tuple[int, int, int]]:
    """:func:`elect_source_rank` for every unit of ``[start, end)`` at once: ``(rank, first, stop)`` runs (PAR-4).

    Candidates hold ascending unit ranges (PAR-1), so the first holder of each
    unit is found by walking them once: each takes what it holds past the last
    one's end. A unit no candidate holds is refused as :func:`elect_source_rank` does.
    """
    runs: list[tuple[int, int, int]] = []
    at = start
    for rank in candidates:
        first, stop = get_owned_units(block, tp_size=producer_tp, tp_rank=rank)
        first, stop = max(first, at), min(stop, end)
        if first >= stop:
            continue
        if first > at:
            break  # unit ``at`` lies before this holder and after every earlier one: nobody holds it
        runs.append((rank, first, stop))
        at = stop
    if at < end:
        raise ParallelismError(f"{block.name}: no producer rank aligned with the consumer rank holds unit {at} (PAR-4)")
    return runs


# --------------------------------------------------------------------------- PAR-5 layout preconditions


def check_page_sliceable(page: CanonicalPage, *, producer_tp: int, consumer_tp: int) -> None:
    """Raise :class:`ParallelismError` naming an ``opaque`` tensor a rank would have to read in part (PAR-5).

    An opaque tensor moves whole: allowed only when every consumer rank owns
    exactly what its source rank owns (equal TP, or every sub-block replicated).
    Checked before any byte moves (PAR-5).
    """
    for tensor in page.tensors:
        if tensor.order is not PageOrder.OPAQUE:
            continue
        for block in tensor.sub_blocks:
            for rank in range(consumer_tp):
                owned = get_owned_units(block, tp_size=consumer_tp, tp_rank=rank)
                for source in get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=rank):
                    if get_owned_units(block, tp_size=producer_tp, tp_rank=source) != owned:
                        raise ParallelismError(
                            f"{tensor.name}.order: expected 'hnd' or 'nhd' to slice {block.name} from TP "
                            f"{producer_tp} to TP {consumer_tp}, got 'opaque' (PAR-5)"
                        )


# --------------------------------------------------------------------------- the plan of one page


_RankTensor = tuple[list[tuple[int, int]], list[int], int]
"""A rank's view of one tensor: per sub-block its owned units and the bytes before them in a row; the row's bytes."""


def _get_rank_tensor(tensor: PageTensor, *, tp_size: int, tp_rank: int) -> _RankTensor:
    """Per sub-block the units a rank owns (PAR-1) and the bytes before them in one row of its tensor (PAR-2)."""
    owned = [get_owned_units(b, tp_size=tp_size, tp_rank=tp_rank) for b in tensor.sub_blocks]
    before: list[int] = []
    at = 0
    for (start, end), block in zip(owned, tensor.sub_blocks, strict=True):
        before.append(at)
        at += (end - start) * block.width * tensor.element_bytes
    return owned, before, at


def _unit_runs(tensor: PageTensor, index: int, start: int, end: int, rank: _RankTensor) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` in a rank's tensor of units ``[start, end)`` of sub-block ``index``, one per run."""
    owned, before, row = rank
    unit = tensor.sub_blocks[index].width * tensor.element_bytes
    at = before[index] + (start - owned[index][0]) * unit
    if tensor.order is PageOrder.NHD:
        return [(r * row + at, (end - start) * unit) for r in range(tensor.rows)]
    return [(tensor.rows * at, (end - start) * tensor.rows * unit)]


def _rank_tensor_bytes(tensor: PageTensor, tp_size: int, tp_rank: int) -> int:
    units = sum(_local_extent(b, tp_size, tp_rank) * b.width for b in tensor.sub_blocks)
    return tensor.rows * units * tensor.element_bytes


def _coalesce(copies: Iterable[RankCopy]) -> tuple[RankCopy, ...]:
    merged: list[RankCopy] = []
    order = operator.attrgetter(*(f.name for f in attrs.fields(RankCopy)))
    for copy in sorted(copies, key=order):  # by producer rank, then offset
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.producer_rank == copy.producer_rank
            and last.producer_page == copy.producer_page
            and last.producer_offset + last.nbytes == copy.producer_offset
            and last.consumer_offset + last.nbytes == copy.consumer_offset
        ):
            merged[-1] = attrs.evolve(last, nbytes=last.nbytes + copy.nbytes)  # goes on on both sides
        else:
            merged.append(copy)
    return tuple(merged)


def compute_rank_copies(
    page: CanonicalPage, *, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> tuple[RankCopy, ...]:
    """The copies that fill consumer rank ``consumer_rank``'s page, each unit from its elected source (PAR-3, PAR-4).

    Per tensor and sub-block, the consumer's units (PAR-1) are split by the
    producer rank elected for each (PAR-4) and placed where each rank's page
    holds them (PAR-2); copies that go on on both sides merge. Offsets are
    within one page; a request repeats them for every paired page (PLAN-1).
    The result tiles the consumer rank's page exactly once (PAR-3).
    """
    check_page_sliceable(page, producer_tp=producer_tp, consumer_tp=consumer_tp)
    copies: list[RankCopy] = []
    candidates = get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank)
    producer_base = dict.fromkeys(candidates, 0)
    consumer_base = 0
    for tensor in page.tensors:
        mine = _get_rank_tensor(tensor, tp_size=consumer_tp, tp_rank=consumer_rank)
        theirs = {rank: _get_rank_tensor(tensor, tp_size=producer_tp, tp_rank=rank) for rank in candidates}
        for index, block in enumerate(tensor.sub_blocks):
            start, end = mine[0][index]
            for source, at, stop in _get_source_runs(block, start, end, candidates, producer_tp=producer_tp):
                reads = _unit_runs(tensor, index, at, stop, theirs[source])
                writes = _unit_runs(tensor, index, at, stop, mine)
                for (p_off, nbytes), (c_off, _) in zip(reads, writes, strict=True):
                    copies.append(
                        RankCopy(
                            producer_rank=source,
                            consumer_rank=consumer_rank,
                            producer_offset=producer_base[source] + p_off,
                            consumer_offset=consumer_base + c_off,
                            nbytes=nbytes,
                        )
                    )
        for rank in candidates:
            producer_base[rank] += tensor.rows * theirs[rank][2]
        consumer_base += tensor.rows * mine[2]
    return _coalesce(copies)


def _element_offset(tensor: PageTensor, index: int, unit: int, row: int, *, tp_size: int, tp_rank: int) -> int:
    """Offset in a rank's tensor of one unit of sub-block ``index`` in one row (PAR-2)."""
    owned = [get_owned_units(b, tp_size=tp_size, tp_rank=tp_rank) for b in tensor.sub_blocks]
    unit_bytes = [b.width * tensor.element_bytes for b in tensor.sub_blocks]
    before = sum((e - s) * u for (s, e), u in zip(owned[:index], unit_bytes[:index], strict=True))
    local = unit - owned[index][0]
    if tensor.order is PageOrder.NHD:
        row_bytes = sum((e - s) * u for (s, e), u in zip(owned, unit_bytes, strict=True))
        return row * row_bytes + before + local * unit_bytes[index]
    return tensor.rows * before + (local * tensor.rows + row) * unit_bytes[index]


def compute_dcp_copies(
    page: CanonicalPage,
    *,
    producer_tp: int,
    consumer_tp: int,
    consumer_rank: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> tuple[RankCopy, ...]:
    """The copies that fill DCP rank ``dcp_rank`` of consumer TP rank ``consumer_rank`` from a producer without DCP.

    The canonical block is ``dcp_size`` producer pages of ``rows`` tokens. In
    a tensor whose rows are tokens, the consumer's row r holds canonical token
    ``t = get_dcp_token_position(r, ...)``, which the producer keeps in page
    ``t // rows``, row ``t % rows``; any other tensor (a state) is held whole
    by every DCP rank and read from page 0. Each unit comes from its elected
    source (PAR-4); copies that go on on both sides, in one producer page, merge.
    With ``dcp_size`` 1 these are :func:`compute_rank_copies` (PAR-8).
    """
    check_page_sliceable(page, producer_tp=producer_tp, consumer_tp=consumer_tp)
    for tensor in page.tensors:
        # An opaque tensor has no addressable rows to deal out (PAR-5).
        if dcp_size > 1 and tensor.token_rows and tensor.order is PageOrder.OPAQUE:
            raise ParallelismError(f"{tensor.name}.order: expected 'hnd' or 'nhd' under DCP, got 'opaque' (PAR-5)")
    copies: list[RankCopy] = []
    candidates = get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank)
    producer_base = dict.fromkeys(candidates, 0)
    consumer_base = 0
    for tensor in page.tensors:
        for index, block in enumerate(tensor.sub_blocks):
            unit_bytes = block.width * tensor.element_bytes
            start, end = get_owned_units(block, tp_size=consumer_tp, tp_rank=consumer_rank)
            for unit in range(start, end):
                source = elect_source_rank(
                    block, unit, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank
                )
                for row in range(tensor.rows):
                    token = get_dcp_token_position(row, dcp_size=dcp_size, dcp_rank=dcp_rank, interleave=interleave)
                    producer_page, producer_row = divmod(token, tensor.rows) if tensor.token_rows else (0, row)
                    copies.append(
                        RankCopy(
                            producer_rank=source,
                            producer_page=producer_page,
                            consumer_rank=consumer_rank,
                            producer_offset=producer_base[source]
                            + _element_offset(tensor, index, unit, producer_row, tp_size=producer_tp, tp_rank=source),
                            consumer_offset=consumer_base
                            + _element_offset(tensor, index, unit, row, tp_size=consumer_tp, tp_rank=consumer_rank),
                            nbytes=unit_bytes,
                        )
                    )
        for rank in candidates:
            producer_base[rank] += _rank_tensor_bytes(tensor, producer_tp, rank)
        consumer_base += _rank_tensor_bytes(tensor, consumer_tp, consumer_rank)
    return _coalesce(copies)


# --------------------------------------------------------------------------- PAR-6 completion count


def get_completion_count(*, producer_tp: int, consumer_tp: int, producer_rank: int, consumer_dcp: int = 1) -> int:
    """Notifications producer rank ``producer_rank`` waits for before it frees a request's blocks (PAR-6).

    Every consumer rank, each DCP rank included, notifies each of its candidate
    ranks (PAR-4) once, whether it read from it or not (MLA with P > D reads one
    of them), so a producer rank frees after exactly the consumer ranks that
    face it: ``max(1, D / P) * consumer_dcp`` (PAR-6).
    """
    return consumer_dcp * sum(
        producer_rank in get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=c)
        for c in range(consumer_tp)
    )


# --------------------------------------------------------------------------- PAR-7 identity pairing


def pair_stage_layers(
    producer_stages: Sequence[Sequence[str]], consumer_stages: Sequence[Sequence[str]]
) -> tuple[StagePair, ...]:
    """Which producer PP stage gives each consumer stage which layers: by layer name, never by position (PAR-7).

    Each producer stage owns its band of layers; a layer held by two producer
    stages, or a consumer layer no producer stage holds, is refused by name.
    Pairs come in consumer-stage order, then producer-stage order (PAR-7).
    """
    owner: dict[str, int] = {}
    for stage, layers in enumerate(producer_stages):
        for layer in layers:
            # One stage owns each layer: two would make two writers (PAR-7).
            if layer in owner:
                raise ParallelismError(
                    f"producer_stages[{stage}]: layer {layer!r} already held by stage {owner[layer]} (PAR-7)"
                )
            owner[layer] = stage
    pairs: list[StagePair] = []
    for c_stage, layers in enumerate(consumer_stages):
        missing = [layer for layer in layers if layer not in owner]
        if missing:
            raise ParallelismError(
                f"consumer_stages[{c_stage}]: layer {missing[0]!r} is held by no producer stage (PAR-7)"
            )
        for p_stage in sorted({owner[layer] for layer in layers}):
            mine = tuple(layer for layer in layers if owner[layer] == p_stage)
            pairs.append(StagePair(producer_stage=p_stage, consumer_stage=c_stage, layers=mine))
    return tuple(pairs)


# --------------------------------------------------------------------------- PAR-8 DCP tokens


def get_dcp_token_position(local_index: int, *, dcp_size: int, dcp_rank: int, interleave: int) -> int:
    """The position in the block's canonical tokens of a DCP rank's ``local_index``-th token (PAR-8).

    Tokens go round the DCP ranks ``interleave`` at a time:
    ``(chunk * dcp_size + dcp_rank) * interleave + pos`` with
    ``chunk, pos = divmod(local_index, interleave)`` (vLLM's canonical mapping) (PAR-8).
    """
    chunk, pos = divmod(local_index, interleave)
    return (chunk * dcp_size + dcp_rank) * interleave + pos


def get_dcp_owner(position: int, *, dcp_size: int, interleave: int) -> tuple[int, int]:
    """``(dcp_rank, local_index)`` of the rank holding canonical token ``position``: PAR-8's map inverted (PAR-8)."""
    turn, pos = divmod(position, interleave)
    chunk, rank = divmod(turn, dcp_size)
    return rank, chunk * interleave + pos


# --------------------------------------------------------------------------- PAR-9 the handshake over byte maps

_TENSOR_FIELDS = ("name", "rows", "element_bytes", "order", "token_rows")
_BLOCK_FIELDS = ("name", "extent", "width", "replicated")


def _plain(value: object) -> object:
    return getattr(value, "value", value)  # an enum as its wire value, as the descriptor reads


def _get_page_difference(producer: CanonicalPage, consumer: CanonicalPage) -> tuple[str, object, object] | None:
    """The first field in which two canonical pages differ, with both values; tensors, then sub-blocks (PAR-9)."""
    if len(producer.tensors) != len(consumer.tensors):
        return "tensors", len(producer.tensors), len(consumer.tensors)
    for j, (p, c) in enumerate(zip(producer.tensors, consumer.tensors, strict=True)):
        for name in _TENSOR_FIELDS:
            if getattr(p, name) != getattr(c, name):
                return f"tensors[{j}].{name}", _plain(getattr(p, name)), _plain(getattr(c, name))
        if len(p.sub_blocks) != len(c.sub_blocks):
            return f"tensors[{j}].sub_blocks", len(p.sub_blocks), len(c.sub_blocks)
        for k, (pb, cb) in enumerate(zip(p.sub_blocks, c.sub_blocks, strict=True)):
            for name in _BLOCK_FIELDS:
                if getattr(pb, name) != getattr(cb, name):
                    return f"tensors[{j}].sub_blocks[{k}].{name}", getattr(pb, name), getattr(cb, name)
    return None


def _get_rank_mismatch(producer: RankLayout, consumer: RankLayout) -> tuple[str, object, object] | None:
    """The first rank field that keeps two ranks from pairing: TP sizes, faced rank, DCP, PP band (PAR-9)."""
    p_tp, c_tp = producer.tp_size, consumer.tp_size
    # One size must divide the other, or units fall between ranks (PAR-4).
    if p_tp % c_tp and c_tp % p_tp:
        return "rank.tp_size (PAR-4)", p_tp, c_tp
    # A consumer rank reads from and notifies its faced ranks only (PAR-4).
    faced = get_candidate_ranks(producer_tp=p_tp, consumer_tp=c_tp, consumer_rank=consumer.tp_rank)
    if producer.tp_rank not in faced:
        return "rank.tp_rank (PAR-4)", producer.tp_rank, consumer.tp_rank
    # The rules deal a producer's tokens out to DCP ranks; a DCP producer pairs only with its own layout (PAR-8).
    p_dcp = (producer.dcp_size, producer.dcp_interleave, p_tp)
    if producer.dcp_size > 1 and p_dcp != (consumer.dcp_size, consumer.dcp_interleave, c_tp):
        return "rank.dcp_size (PAR-8)", producer.dcp_size, consumer.dcp_size
    # Two stages that share no layer have nothing to exchange: a pairing by position would invent one (PAR-7).
    if producer.layers and consumer.layers and not set(producer.layers) & set(consumer.layers):
        return "rank.layers (PAR-7)", producer.layers, consumer.layers
    return None


def _one_row(page: CanonicalPage) -> CanonicalPage:
    # Every row of a tensor repeats the first one's byte map (PAR-2), so one row shows coverage for all.
    return CanonicalPage(tensors=[attrs.evolve(t, rows=1) for t in page.tensors])


def _get_map_mismatch(
    page: CanonicalPage, producer: RankLayout, consumer: RankLayout
) -> tuple[str, object, object] | None:
    """The first rule two ranks' byte maps of one page break: ownership, layout, coverage (PAR-1, PAR-5, PAR-3)."""
    p_tp, c_tp = producer.tp_size, consumer.tp_size
    for j, tensor in enumerate(page.tensors):
        for k, block in enumerate(tensor.sub_blocks):
            for tp_size, tp_rank in ((p_tp, producer.tp_rank), (c_tp, consumer.tp_rank)):
                try:
                    get_owned_units(block, tp_size=tp_size, tp_rank=tp_rank)
                except ParallelismError:
                    field = f"tensors[{j}].sub_blocks[{k}].extent (PAR-1)"
                    return field, f"{block.extent} at TP {p_tp}", f"{block.extent} at TP {c_tp}"
        # Under DCP a token tensor is dealt out by rows, which an opaque tensor does not have (PAR-5, PAR-8).
        opaque_rows = consumer.dcp_size > 1 and tensor.token_rows and tensor.order is PageOrder.OPAQUE
        try:
            if opaque_rows:
                raise ParallelismError(f"{tensor.name}.order: expected 'hnd' or 'nhd' under DCP, got 'opaque' (PAR-5)")
            check_page_sliceable(CanonicalPage(tensors=[tensor]), producer_tp=p_tp, consumer_tp=c_tp)
        except ParallelismError:
            return f"tensors[{j}].order (PAR-5)", f"'opaque' at TP {p_tp}", f"'opaque' at TP {c_tp}"
    row = _one_row(page)
    kwargs = {"producer_tp": p_tp, "consumer_tp": c_tp, "consumer_rank": consumer.tp_rank}
    try:
        check_coverage(row, copies=compute_rank_copies(row, **kwargs), **kwargs)
    except ParallelismError as exc:
        return "coverage (PAR-3)", f"TP {p_tp}", str(exc)
    return None


def get_layout_mismatch(*, producer: ParallelLayout, consumer: ParallelLayout) -> tuple[str, object, object] | None:
    """The first field that keeps two ranks' byte maps from composing, with both values; None admits the pair (PAR-9).

    The layouts must describe the same canonical pages: same count, and per
    page the same tensors (name, rows, element size, order, token rows) and
    sub-blocks (name, extent, width, replication), compared in that order.
    Then the ranks must pair (:func:`check_tp_pair`, the producer rank one the
    consumer rank faces, DCP only from a producer without it unless both
    agree, a PP band in common), every sub-block must divide at both TP sizes
    (PAR-1), every tensor be sliceable (PAR-5), and the planner's copies tile
    the consumer rank's page (PAR-3). The field carries the rule it breaks,
    e.g. ``"pages[0].tensors[0].order (PAR-5)"``. The handshake refuses on the
    first mismatch, in place of equal TP sizes (HS-1, PAR-9).
    """
    if len(producer.pages) != len(consumer.pages):
        return "pages (PAR-9)", len(producer.pages), len(consumer.pages)
    for i, (p_page, c_page) in enumerate(zip(producer.pages, consumer.pages, strict=True)):
        difference = _get_page_difference(p_page, c_page)
        if difference is not None:
            field, p_value, c_value = difference
            return f"pages[{i}].{field} (PAR-9)", p_value, c_value
    mismatch = _get_rank_mismatch(producer.rank, consumer.rank)
    if mismatch is not None:
        return mismatch
    for i, page in enumerate(producer.pages):
        mismatch = _get_map_mismatch(page, producer.rank, consumer.rank)
        if mismatch is not None:
            field, p_value, c_value = mismatch
            return f"pages[{i}].{field}", p_value, c_value
    return None
