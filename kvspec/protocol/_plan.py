"""The transfer planner: aligned block pairs -> the fewest byte-range copies (PLAN-1)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from operator import attrgetter
from typing import TypeAlias

import attrs

from kvspec.core._descriptors import DescriptorList
from kvspec.core._enums import TransferMode
from kvspec.core._errors import PlanError
from kvspec.core._models import KVCacheConfig
from kvspec.spec.plan import (
    BlockPairsLike,
    PageCopy,
    _check_configs,
    _check_group_layout,
    compute_page_copies,
    get_page_byte_ranges,
)

__all__ = [
    "BlockPairsLike",
    "GroupPlan",
    "PageCopy",
    "TransferPlan",
    "plan_transfer",
]


@attrs.frozen(kw_only=True)
class GroupPlan:
    """What one KV-cache group contributes to a plan.

    ``page_size`` is the group's page, padding included; ``moved_per_page``
    the bytes of each page that move when they are fewer: a state group's
    state tensors, without the padding (PLAN-1). ``None``: the whole page.
    """

    group_index: int
    num_pairs: int
    num_layers: int
    page_size: int
    moved_per_page: int | None = None

    @property
    def num_pages(self) -> int:
        """Pages copied for this group: one per (layer, pair)."""
        return self.num_pairs * self.num_layers

    @property
    def bytes_per_page(self) -> int:
        """Bytes moved per page: the whole page, or a state group's state tensors."""
        return self.page_size if self.moved_per_page is None else self.moved_per_page

    @property
    def nbytes(self) -> int:
        """Bytes moved for this group."""
        return self.num_pages * self.bytes_per_page


_COPY_FIELDS = ("producer_region", "producer_offset", "consumer_region", "consumer_offset", "nbytes")
Columns: TypeAlias = "tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]"


def _to_group_plans(value: Sequence[GroupPlan]) -> tuple[GroupPlan, ...]:
    return tuple(value)


def _page_copy(pr: int, po: int, cr: int, co: int, n: int) -> PageCopy:
    return PageCopy(producer_region=pr, producer_offset=po, consumer_region=cr, consumer_offset=co, nbytes=n)


@attrs.frozen(kw_only=True, init=False, eq=False)
class TransferPlan:
    """Every byte one request moves, as merged role-named copies (PLAN-1).

    ``total_bytes`` is exactly the bytes of the paired pages: one page per
    (layer of the group, pair), no more and no fewer; of a state group's
    page, its state tensors' bytes and never the padding. The copies are held as
    five int columns (one per :class:`PageCopy` field); ``copies`` builds the
    objects on first use, and :meth:`to_descriptors` packs the columns without
    building them.
    """

    groups: tuple[GroupPlan, ...]
    _columns: Columns = attrs.field(repr=False)
    _copies: list[tuple[PageCopy, ...]] = attrs.field(repr=False)  # built on first use of ``copies``

    def __init__(self, *, copies: Sequence[PageCopy], groups: Sequence[GroupPlan]) -> None:
        """A plan from its copies and the groups they came from."""
        copies = tuple(copies)
        columns = tuple(tuple(map(attrgetter(name), copies)) for name in _COPY_FIELDS)
        self.__attrs_init__(groups=_to_group_plans(groups), columns=columns, copies=[copies])  # type: ignore[arg-type]

    @classmethod
    def _from_columns(cls, columns: Columns, groups: Sequence[GroupPlan]) -> TransferPlan:
        plan = object.__new__(cls)
        plan.__attrs_init__(groups=_to_group_plans(groups), columns=columns, copies=[])
        return plan

    @property
    def copies(self) -> tuple[PageCopy, ...]:
        """The merged copies, ordered by producer region and offset."""
        if not self._copies:
            self._copies.append(tuple(map(_page_copy, *self._columns)))
        return self._copies[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferPlan):
            return NotImplemented
        return self._columns == other._columns and self.groups == other.groups

    def __hash__(self) -> int:
        return hash((self._columns, self.groups))

    def __repr__(self) -> str:
        return f"TransferPlan(copies={list(self.copies)!r}, groups={list(self.groups)!r})"

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves; equals the sum of its groups' bytes."""
        return sum(self._columns[4])

    @property
    def num_descriptors(self) -> int:
        """Number of merged copies, i.e. descriptors a backend receives."""
        return len(self._columns[4])

    @property
    def num_pages(self) -> int:
        """Number of pages before merging."""
        return sum(group.num_pages for group in self.groups)

    def to_descriptors(self, mode: TransferMode) -> DescriptorList:
        """Map role-named copies onto the posting agent's local/remote regions.

        READ: the consumer posts, so local = consumer and remote = producer.
        WRITE: the producer posts, so local = producer and remote = consumer.
        This is the only place the role -> initiator mapping is made (ADM-2).
        The result is packed (:class:`kvspec.transport.DescriptorList`) from the
        plan's columns, with no object per copy: O(copies).
        """
        p_region, p_offset, c_region, c_offset, nbytes = self._columns
        producer, consumer = (p_region, p_offset), (c_region, c_offset)
        if mode is TransferMode.READ or mode is TransferMode.WRITE:
            (local_region, local_offset), (remote_region, remote_offset) = (
                (consumer, producer) if mode is TransferMode.READ else (producer, consumer)
            )
            return DescriptorList.from_columns(
                local_region=local_region,
                local_offset=local_offset,
                remote_region=remote_region,
                remote_offset=remote_offset,
                nbytes=nbytes,
            )
        raise PlanError(f"to_descriptors: expected a TransferMode, got {mode!r}")


# ------------------------------------------------ the definition, where the fast path cannot prove its answer


def _moved_per_page(config: KVCacheConfig, group: int) -> int | None:
    """Bytes of each page that move when fewer than the page (a state group's tensors), else None (PLAN-1)."""
    spec = config.kv_cache_groups[group].kv_cache_spec
    moved = sum(nbytes for _, nbytes in get_page_byte_ranges(spec))
    return None if moved == spec.page_size_bytes else moved


def _plan_by_definition(
    producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
) -> TransferPlan:
    """:func:`kvspec.spec.compute_page_copies`'s copies as a plan: its checks and errors, one ``PageCopy`` a page.

    It takes any pairs and layouts (duplicate ids, tensors shared by groups,
    layers interleaved in a tensor) and finds every error with its exact
    position; :func:`plan_transfer` falls back to it whenever its fast path
    cannot prove the same answer (PLAN-1).
    """
    copies = compute_page_copies(producer_config=producer_config, consumer_config=consumer_config, pairs=pairs)
    groups = [
        GroupPlan(
            group_index=g,
            num_pairs=len(producer_ids),
            num_layers=len(producer_config.kv_cache_groups[g].layer_names),
            page_size=_check_group_layout(producer_config, consumer_config, g),
            moved_per_page=_moved_per_page(producer_config, g),
        )
        for g, producer_ids in enumerate(pairs.producer_block_ids)
    ]
    columns = tuple(zip(*map(attrs.astuple, copies), strict=True)) if copies else ((), (), (), (), ())
    return TransferPlan._from_columns(columns, groups)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- planning, fast path


@attrs.frozen
class _Run:
    """Layers of one group whose pages for one block sit side by side on both sides: one copy per pair.

    In a state group whose pages end in padding (``moved`` set), each layer's
    page gives its own copy of ``moved`` bytes instead: the padding between
    them never moves (PLAN-1).
    """

    p_region: int
    p_base: int
    p_stride: int
    c_region: int
    c_base: int
    c_stride: int
    nbytes: int  # the run's pages, padding included: what its span covers
    page: int
    moved: int | None = None

    @property
    def linkable(self) -> bool:
        """Whether block b + 1's copy continues block b's on both sides (a block stride equal to the run)."""
        return self.moved is None and self.p_stride == self.nbytes and self.c_stride == self.nbytes


@attrs.frozen
class _GroupLayout:
    runs: tuple[_Run, ...]
    num_layers: int
    page: int
    moved_per_page: int | None  # a state group's state bytes per page, when fewer than the page
    p_max_id: int  # the largest producer id whose page fits in every layer's tensor
    c_max_id: int


@attrs.frozen
class _PairLayout:
    """What the fast path precomputes once per (producer config, consumer config) pair."""

    groups: tuple[_GroupLayout, ...]
    order: tuple[tuple[int, int], ...]  # (group, run): the runs in producer (region, offset) order
    fast: bool  # False: some group or tensor is laid out so that only the page-by-page planner is exact


def _layer_slot(config: KVCacheConfig, layer: str) -> tuple[int, int, int, int]:
    """(region, base offset, block stride, tensor size) of one layer's pages."""
    loc = config.locate(layer)
    tensor = config.kv_cache_tensors[loc.tensor_index]
    return loc.tensor_index, tensor.offset + loc.layer_index * tensor.layer_stride, tensor.block_stride, tensor.size


def _group_layout(producer: KVCacheConfig, consumer: KVCacheConfig, g: int) -> _GroupLayout | None:
    p_group, c_group = producer.kv_cache_groups[g], consumer.kv_cache_groups[g]
    page = p_group.kv_cache_spec.page_size_bytes
    ranges = get_page_byte_ranges(p_group.kv_cache_spec)
    if (
        p_group.layer_names != c_group.layer_names
        or c_group.kv_cache_spec.page_size_bytes != page
        or get_page_byte_ranges(c_group.kv_cache_spec) != ranges
    ):
        return None  # the page-by-page planner raises the HS-1 / STATE-5 error, in its order
    # The moved bytes of a page are one range from its start (a state group's tensors lie back to back):
    # one copy per page, as the page-by-page planner's merge makes of them.
    end = ranges[-1][0] + ranges[-1][1]
    if ranges[0][0] != 0 or any(a[0] + a[1] != b[0] for a, b in itertools.pairwise(ranges)):
        return None
    moved = None if end == page else end
    slots = sorted((_layer_slot(producer, name), _layer_slot(consumer, name)) for name in p_group.layer_names)
    runs: list[_Run] = []
    p_max_id = c_max_id = producer.num_blocks + consumer.num_blocks
    for (pr, pb, ps, p_size), (cr, cb, cs, c_size) in slots:
        p_max_id = min(p_max_id, (p_size - page - pb) // ps)
        c_max_id = min(c_max_id, (c_size - page - cb) // cs)
        last = runs[-1] if runs else None
        if (
            last is not None
            and (pr, ps, cr, cs) == (last.p_region, last.p_stride, last.c_region, last.c_stride)
            and pb == last.p_base + last.nbytes
            and cb == last.c_base + last.nbytes
        ):
            runs[-1] = attrs.evolve(last, nbytes=last.nbytes + page)  # the next layer's page follows on both sides
        else:
            runs.append(
                _Run(
                    p_region=pr,
                    p_base=pb,
                    p_stride=ps,
                    c_region=cr,
                    c_base=cb,
                    c_stride=cs,
                    nbytes=page,
                    page=page,
                    moved=moved,
                )
            )
    return _GroupLayout(
        runs=tuple(runs),
        num_layers=len(p_group.layer_names),
        page=page,
        moved_per_page=moved,
        p_max_id=p_max_id,
        c_max_id=c_max_id,
    )


def _separated(spans: list[tuple[int, int, int]], *, strict: bool) -> bool:
    # (region, start, end) per run: no two overlap (strict: nor touch) within a region.
    spans.sort()
    return all(a[0] != b[0] or (a[2] < b[1] if strict else a[2] <= b[1]) for a, b in itertools.pairwise(spans))


def _pair_layout(producer: KVCacheConfig, consumer: KVCacheConfig) -> _PairLayout:
    """Runs per group, and whether merging per run gives exactly the page-by-page answer.

    It does when, for every id in ``[1, num_blocks)``: a run's pages never
    overlap one another (block stride at least the run's bytes), the spans of
    different runs in one region never overlap on either side, and on one side
    they do not even touch (so no copy of one run continues a copy of
    another). Then each copy the page-by-page merge would make lies inside
    one run, and runs sort by their span.
    """
    if producer.num_groups != consumer.num_groups or producer.num_blocks < 2 or consumer.num_blocks < 2:
        return _PairLayout(groups=(), order=(), fast=False)
    layouts = [_group_layout(producer, consumer, g) for g in range(producer.num_groups)]
    if any(layout is None for layout in layouts):
        return _PairLayout(groups=(), order=(), fast=False)
    groups = tuple(layout for layout in layouts if layout is not None)
    p_spans, c_spans, order = [], [], []
    fast = True
    for g, layout in enumerate(groups):
        for r, run in enumerate(layout.runs):
            fast &= run.p_stride >= run.nbytes and run.c_stride >= run.nbytes
            p_start = run.p_base + run.p_stride
            p_spans.append((run.p_region, p_start, run.p_base + (producer.num_blocks - 1) * run.p_stride + run.nbytes))
            c_start = run.c_base + run.c_stride
            c_spans.append((run.c_region, c_start, run.c_base + (consumer.num_blocks - 1) * run.c_stride + run.nbytes))
            order.append((run.p_region, p_start, g, r))
    fast &= _separated(list(p_spans), strict=False) and _separated(list(c_spans), strict=False)
    fast &= _separated(p_spans, strict=True) or _separated(c_spans, strict=True)
    return _PairLayout(groups=groups, order=tuple((g, r) for _, _, g, r in sorted(order)), fast=fast)


_LAYOUT_CACHE: dict[tuple[int, int], tuple[KVCacheConfig, KVCacheConfig, _PairLayout]] = {}
_LAYOUT_CACHE_SIZE = 32


def _cached_pair_layout(producer: KVCacheConfig, consumer: KVCacheConfig) -> _PairLayout:
    """Per config pair, computed once: an engine plans every request against the same two configs."""
    key = (id(producer), id(consumer))
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None and hit[0] is producer and hit[1] is consumer:
        return hit[2]
    if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_SIZE:
        _LAYOUT_CACHE.clear()
    layout = _pair_layout(producer, consumer)
    _LAYOUT_CACHE[key] = (producer, consumer, layout)  # holding the configs keeps their ids from being reused
    return layout


def _consecutive(ids: Sequence[int]) -> bool:
    # One run of ids counting up by one, as a fresh pool hands them out: O(n) at C speed, no sort needed.
    return ids[-1] - ids[0] == len(ids) - 1 and tuple(ids) == tuple(range(ids[0], ids[-1] + 1))


@attrs.frozen
class _SortedPairs:
    """One group's pairs sorted by producer id, cut into chains where both ids count up by one."""

    p_ids: Sequence[int]  # all pairs, by producer id
    c_ids: Sequence[int]
    p_first: Sequence[int]  # the first pair of each chain
    c_first: Sequence[int]
    lengths: Sequence[int]  # pairs per chain


def _sorted_pairs(
    producer_ids: Sequence[int], consumer_ids: Sequence[int], layout: _GroupLayout, p_blocks: int, c_blocks: int
) -> _SortedPairs | None:
    """Checks and sorts one group's pairs with whole-list operations; None when a check fails.

    Checked, as the page-by-page planner checks them one by one: every id
    real (not the null block, NULL-1) and below ``num_blocks``, every page
    inside its tensor (the largest id bounds them all), and the ids of each
    side distinct (so no two copies touch the same bytes).
    """
    n = len(producer_ids)
    p_top, c_top = min(p_blocks - 1, layout.p_max_id), min(c_blocks - 1, layout.c_max_id)
    if _consecutive(producer_ids) and _consecutive(consumer_ids):
        if producer_ids[0] < 1 or consumer_ids[0] < 1 or producer_ids[-1] > p_top or consumer_ids[-1] > c_top:
            return None
        return _SortedPairs(
            p_ids=producer_ids,
            c_ids=consumer_ids,
            p_first=producer_ids[:1],
            c_first=consumer_ids[:1],
            lengths=[n],
        )
    if min(consumer_ids) < 1 or max(consumer_ids) > c_top or len(set(consumer_ids)) != n:
        return None
    # One int per pair, producer id major: a plain sort orders the pairs by producer id.
    width = c_blocks
    keys = sorted(map(operator.add, map(operator.mul, producer_ids, itertools.repeat(width)), consumer_ids))
    if keys[0] // width < 1 or keys[-1] // width > p_top:
        return None
    # Consecutive keys one producer id and one consumer id apart differ by width + 1: the chain goes on.
    breaks = list(itertools.compress(range(1, n), map((width + 1).__ne__, map(operator.sub, keys[1:], keys))))
    firsts = keys if len(breaks) == n - 1 else [keys[0], *map(keys.__getitem__, breaks)]
    lengths = list(map(operator.sub, [*breaks, n], [0, *breaks]))
    p_first = list(map(operator.floordiv, firsts, itertools.repeat(width)))
    # Producer ids distinct: each chain ends below the next chain's first producer id.
    if not all(map(operator.le, map(operator.add, p_first, lengths), p_first[1:])):
        return None
    c_first = list(map(operator.mod, firsts, itertools.repeat(width)))
    if firsts is keys:
        return _SortedPairs(p_ids=p_first, c_ids=c_first, p_first=p_first, c_first=c_first, lengths=lengths)
    return _SortedPairs(
        p_ids=list(map(operator.floordiv, keys, itertools.repeat(width))),
        c_ids=list(map(operator.mod, keys, itertools.repeat(width))),
        p_first=p_first,
        c_first=c_first,
        lengths=lengths,
    )


def _plan_fast(
    layout: _PairLayout, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
) -> TransferPlan | None:
    """The plan, from whole-list operations per group and arithmetic per run; None when a check fails.

    Per group: the bulk checks, one sort of the pairs by producer id (none for
    a consecutive allocation) and the points where producer or consumer ids
    stop counting up by one. Per run of adjacent layers: one offset column per
    side. O(n log n) in the pairs plus O(copies); no object per page.
    """
    pieces: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
    group_plans: list[GroupPlan] = []
    both = zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)
    for g, (producer_ids, consumer_ids) in enumerate(both):
        n = len(producer_ids)
        if n != len(consumer_ids):
            raise PlanError(f"group {g}: {n} producer ids paired with {len(consumer_ids)} consumer ids")
        group = layout.groups[g]
        group_plans.append(
            GroupPlan(
                group_index=g,
                num_pairs=n,
                num_layers=group.num_layers,
                page_size=group.page,
                moved_per_page=group.moved_per_page,
            )
        )
        if not n:
            continue
        ordered = _sorted_pairs(
            producer_ids, consumer_ids, group, producer_config.num_blocks, consumer_config.num_blocks
        )
        if ordered is None:
            return None  # the page-by-page planner names the first bad id, page or overlap
        for r, run in enumerate(group.runs):
            if run.moved is not None:
                # A state group's padded pages: one copy of the state bytes per layer page, in producer order.
                layer_starts = range(0, run.nbytes, run.page)
                p_offsets = [run.p_base + p_id * run.p_stride + at for p_id in ordered.p_ids for at in layer_starts]
                c_offsets = [run.c_base + c_id * run.c_stride + at for c_id in ordered.c_ids for at in layer_starts]
                pieces[g, r] = p_offsets, c_offsets, [run.moved] * len(p_offsets)
                continue
            if run.linkable:
                p_ids, c_ids = ordered.p_first, ordered.c_first
                nbytes = [length * run.nbytes for length in ordered.lengths]
            else:
                p_ids, c_ids, nbytes = ordered.p_ids, ordered.c_ids, [run.nbytes] * n
            p_offsets = [run.p_base + p_id * run.p_stride for p_id in p_ids]
            c_offsets = [run.c_base + c_id * run.c_stride for c_id in c_ids]
            pieces[g, r] = p_offsets, c_offsets, nbytes
    columns: tuple[list[int], ...] = ([], [], [], [], [])
    p_region, p_offset, c_region, c_offset, nbytes_column = columns
    for g, r in layout.order:
        piece = pieces.get((g, r))
        if piece is None:
            continue
        run = layout.groups[g].runs[r]
        p_region.extend(itertools.repeat(run.p_region, len(piece[0])))
        p_offset.extend(piece[0])
        c_region.extend(itertools.repeat(run.c_region, len(piece[0])))
        c_offset.extend(piece[1])
        nbytes_column.extend(piece[2])
    return TransferPlan._from_columns(tuple(map(tuple, columns)), group_plans)  # type: ignore[arg-type]


def plan_transfer(
    *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
) -> TransferPlan:
    """Turn aligned block pairs into the fewest copies that move exactly their pages (PLAN-1).

    One page per (layer of the group, pair); layers pair by name; of a state
    group's page only its state tensors' bytes, never the padding
    (:func:`kvspec.spec.get_page_byte_ranges`). Copies that
    are contiguous on both sides merge into one. Every block id is checked
    against ``num_blocks`` (the null block is refused, NULL-1) and every page
    against its tensor's size before a plan is returned, so nothing is posted
    from a plan that would leave the pools. Zero groups (full prefix hit) give
    an empty plan.

    Cost: the layout of the two configs is analysed once per config pair and
    cached. Per request, when the layout keeps every group's layers apart
    (each preset layout but ``shared``) and the ids of each group are
    distinct, the checks are whole-list operations and the copies come from
    one sort of the pairs per group and arithmetic per run of adjacent layers:
    O(n log n) in the pairs plus O(copies), no object per page
    (docs/explanation/engine-cost.md). Otherwise (duplicate ids, a bad id, a
    shared tensor) the plan is the definition's,
    :func:`kvspec.spec.compute_page_copies`, one ``PageCopy`` a page, and
    reports the first bad id, page or overlap exactly as it does.
    """
    _check_configs(producer_config, consumer_config, pairs)
    if len(pairs.consumer_block_ids):
        layout = _cached_pair_layout(producer_config, consumer_config)
        if layout.fast:
            plan = _plan_fast(layout, producer_config, consumer_config, pairs)
            if plan is not None:
                return plan
    return _plan_by_definition(producer_config, consumer_config, pairs)
