"""Plan reporting: what one request would move, with and without clipping (CLIP-1, PLAN-1).

It runs the reference functions and the planner over fresh, contiguous block
tables, so ``kvspec plan`` and the docs' figures can show what clipping saves
for a model without an engine. A state group (Mamba, GDN, KDA) moves one slot
per request after clipping (STATE-2), and of each of its pages only the state
tensors' bytes (PLAN-1); its figures are shown beside the attention groups'.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import attrs

from kvspec.core._enums import TransferMode
from kvspec.core._models import BlockIds, KVCacheConfig, KVCacheSpec, MambaSpec
from kvspec.protocol._plan import plan_transfer
from kvspec.reference._reference import (
    BlockPairs,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_pruned_block_ids,
)
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.parallel import (
    CanonicalPage,
    RankCopy,
    compute_dcp_copies,
    compute_rank_copies,
    get_candidate_ranks,
    get_completion_count,
    pair_stage_layers,
)
from kvspec.spec.plan import get_page_byte_ranges

__all__ = [
    "GroupSummary",
    "ParallelPlanSummary",
    "PlanSummary",
    "RankRead",
    "blocks_needed_for",
    "get_stage_bands",
    "summarize_parallel_plan",
    "summarize_plan",
    "without_state_groups",
]


def _to_ints(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class GroupSummary:
    """One group's share of a request, with and without clipping (CLIP-1, STATE-2, PLAN-1).

    ``page_size`` is the group's page, padding included. A state group also
    names its kind (``mamba_type``) and the bytes of each state tensor
    (``state_tensor_bytes``, conv then SSM); only those move per page, never
    the padding (PLAN-1). Attention groups move whole pages.
    """

    group_index: int
    kind: str
    block_size: int
    sliding_window: int | None
    num_layers: int
    page_size: int
    blocks_unclipped: int
    blocks_clipped: int
    mamba_type: str | None = None
    state_tensor_bytes: tuple[int, ...] = attrs.field(default=(), converter=_to_ints)

    @property
    def is_state(self) -> bool:
        """Whether this is a state group (Mamba, GDN, KDA: STATE-1 .. STATE-5)."""
        return self.mamba_type is not None

    @property
    def bytes_per_page(self) -> int:
        """Bytes each page moves: the whole page, or a state group's tensors without the padding (PLAN-1)."""
        return sum(self.state_tensor_bytes) if self.is_state else self.page_size

    @property
    def bytes_unclipped(self) -> int:
        """Bytes moved when every block (every state slot) of the uncached suffix is sent."""
        return self.blocks_unclipped * self.num_layers * self.bytes_per_page

    @property
    def bytes_clipped(self) -> int:
        """Bytes moved after clipping to the window budget (one slot per state group, STATE-2)."""
        return self.blocks_clipped * self.num_layers * self.bytes_per_page


def _to_group_summaries(value: Sequence[GroupSummary]) -> tuple[GroupSummary, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class PlanSummary:
    """What one request of ``num_tokens`` tokens moves, per group and in total.

    ``descriptors_*`` count merged copies for fresh, contiguous block
    allocations on both sides (the best case; a fragmented pool gives up to
    ``pages_*``).
    """

    num_tokens: int
    prefix_hit_tokens: int
    mode: TransferMode
    groups: tuple[GroupSummary, ...] = attrs.field(converter=_to_group_summaries)
    descriptors_unclipped: int
    descriptors_clipped: int

    @property
    def bytes_unclipped(self) -> int:
        """Total bytes without clipping."""
        return sum(g.bytes_unclipped for g in self.groups)

    @property
    def bytes_clipped(self) -> int:
        """Total bytes with clipping."""
        return sum(g.bytes_clipped for g in self.groups)

    @property
    def bytes_saved(self) -> int:
        """Bytes clipping saves."""
        return self.bytes_unclipped - self.bytes_clipped

    @property
    def state_bytes_clipped(self) -> int:
        """Bytes the state groups move with clipping: one slot each (STATE-2), state tensors only (PLAN-1)."""
        return sum(g.bytes_clipped for g in self.groups if g.is_state)

    @property
    def attention_bytes_clipped(self) -> int:
        """Bytes the attention groups move with clipping."""
        return sum(g.bytes_clipped for g in self.groups if not g.is_state)

    @property
    def pages_unclipped(self) -> int:
        """Pages (unmerged copies) without clipping."""
        return sum(g.blocks_unclipped * g.num_layers for g in self.groups)

    @property
    def pages_clipped(self) -> int:
        """Pages (unmerged copies) with clipping."""
        return sum(g.blocks_clipped * g.num_layers for g in self.groups)


def _contiguous_ids(counts: Sequence[int], first: int = 1) -> BlockIds:
    groups, next_id = [], first
    for n in counts:
        groups.append(range(next_id, next_id + n))
        next_id += n
    return BlockIds(groups)


def without_state_groups(config: KVCacheConfig) -> KVCacheConfig | None:
    """``config`` with its attention groups only (same tensors), or None when every group is a state group."""
    groups = [g for g in config.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    if len(groups) == config.num_groups:
        return config
    return attrs.evolve(config, kv_cache_groups=groups) if groups else None


def _state_slots(spec: MambaSpec, *, num_tokens: int, prefix_hit_tokens: int) -> int:
    """Slots a request's state list holds for the uncached suffix, scratch slots included (STATE-2, STATE-4).

    In ``"align"`` mode slot ``p`` holds the state after ``(p + 1) * B`` tokens, so the suffix spans
    ``cdiv(T, B) - H / B`` slots; in ``"none"`` mode a request holds one state. Then the speculative
    scratch slots. Zero when ``H == T``: the consumer's own state is h(H) (STATE-4).
    """
    if prefix_hit_tokens >= num_tokens:
        return 0
    states = 1
    if spec.cache_mode == "align":
        states = -(-num_tokens // spec.block_size) - prefix_hit_tokens // spec.block_size
    return states + spec.num_speculative_blocks


def _attention_pairs(
    config: KVCacheConfig | None, *, num_tokens: int, prefix_hit_tokens: int
) -> tuple[BlockPairs, BlockPairs]:
    """Unclipped and clipped pairs of the attention groups, over fresh contiguous ids from block 1."""
    if config is None:
        empty = BlockPairs(producer_block_ids=BlockIds([]), consumer_block_ids=BlockIds([]))
        return empty, empty
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    totals = [get_logical_block_count(s, num_tokens=num_tokens) for s in specs]
    suffix = [t - prefix_hit_tokens // s.block_size for t, s in zip(totals, specs, strict=True)]
    producer_full = _contiguous_ids(totals)
    unclipped = _align_pairs_unchecked(producer_full, _contiguous_ids(suffix))
    producer_sent = get_exchange_clipped_blocks(
        get_pruned_block_ids(config, producer_full, num_computed_tokens=num_tokens), get_blocks_per_sw(config)
    )
    consumer_counts = get_consumer_block_counts(config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
    consumer_ids = _contiguous_ids(consumer_counts) if prefix_hit_tokens < num_tokens else BlockIds([])
    clipped = compute_transfer_pairs(
        config,
        TransferRequest(
            num_tokens=num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            producer_block_ids=producer_sent,
            consumer_block_ids=consumer_ids,
        ),
    )
    return unclipped, clipped


def _with_state_groups(
    config: KVCacheConfig, attention: BlockPairs, state_counts: dict[int, int], first_id: int
) -> BlockPairs:
    """The attention groups' pairs with ``state_counts[g]`` fresh slots paired in each state group ``g``.

    Zero groups stay zero when every group has nothing to move (a full prefix hit, CLIP-1).
    """
    if not len(attention.consumer_block_ids) and not any(state_counts.values()):
        return attention
    producer: list[Sequence[int]] = []
    consumer: list[Sequence[int]] = []
    a, next_id = 0, first_id
    for g in range(config.num_groups):
        if g in state_counts:
            ids = range(next_id, next_id + state_counts[g])
            next_id += state_counts[g]
            producer.append(ids)
            consumer.append(ids)
        else:
            attention_ids = len(attention.consumer_block_ids) > 0
            producer.append(attention.producer_block_ids[a] if attention_ids else ())
            consumer.append(attention.consumer_block_ids[a] if attention_ids else ())
            a += 1
    return BlockPairs(producer_block_ids=BlockIds(producer), consumer_block_ids=BlockIds(consumer))


def _state_fields(spec: KVCacheSpec) -> dict[str, object]:
    if not isinstance(spec, MambaSpec):
        return {}
    return {
        "mamba_type": spec.mamba_type,
        "state_tensor_bytes": [nbytes for _, nbytes in get_page_byte_ranges(spec)],
    }


def summarize_plan(
    config: KVCacheConfig, *, num_tokens: int, prefix_hit_tokens: int = 0, mode: TransferMode = TransferMode.READ
) -> PlanSummary:
    """What a request moves with and without clipping, for ``config``'s layout (CLIP-1, WIN-1, STATE-2, PLAN-1).

    Without clipping, every block of the uncached suffix ``[H, T)`` moves in
    every attention group, and every slot of its state list (scratch slots
    included) in every state group. With clipping, the producer prunes and
    clips its table and the consumer allocates only what it needs, as the
    exchange does, and each state group moves exactly one slot (STATE-2; none
    when ``H == T``, STATE-4). State pages move their state tensors' bytes,
    never the padding (PLAN-1). ``config`` must have enough blocks for both
    tables; :func:`blocks_needed_for` says how many.
    """
    attention = without_state_groups(config)
    unclipped_attention, clipped_attention = _attention_pairs(
        attention, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens
    )
    attention_groups = attention.kv_cache_groups if attention is not None else ()
    first_state_id = 1 + sum(get_logical_block_count(g.kv_cache_spec, num_tokens=num_tokens) for g in attention_groups)
    state_unclipped, state_clipped = {}, {}
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            state_unclipped[g] = _state_slots(spec, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
            state_clipped[g] = min(1, state_unclipped[g])
    unclipped = _with_state_groups(config, unclipped_attention, state_unclipped, first_state_id)
    clipped = _with_state_groups(config, clipped_attention, state_clipped, first_state_id)
    plan_unclipped = plan_transfer(producer_config=config, consumer_config=config, pairs=unclipped)
    plan_clipped = plan_transfer(producer_config=config, consumer_config=config, pairs=clipped)
    groups = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        groups.append(
            GroupSummary(
                group_index=g,
                kind=spec.kind.value,
                block_size=spec.block_size,
                sliding_window=window if isinstance(window, int) else None,
                num_layers=len(group.layer_names),
                page_size=spec.page_size_bytes,
                blocks_unclipped=len(unclipped.consumer_block_ids[g]) if len(unclipped.consumer_block_ids) else 0,
                blocks_clipped=len(clipped.consumer_block_ids[g]) if len(clipped.consumer_block_ids) else 0,
                **_state_fields(spec),  # type: ignore[arg-type]
            )
        )
    return PlanSummary(
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        mode=mode,
        groups=groups,
        descriptors_unclipped=plan_unclipped.num_descriptors,
        descriptors_clipped=plan_clipped.num_descriptors,
    )


def blocks_needed_for(config: KVCacheConfig, *, num_tokens: int) -> int:
    """Blocks (null block included) a pool needs for one request's full table on one side, state slots included."""
    needed = 1
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        needed += -(-num_tokens // spec.block_size)
        if isinstance(spec, MambaSpec):
            needed += spec.num_speculative_blocks
    return needed


def _align_pairs_unchecked(producer_block_ids: BlockIds, consumer_block_ids: BlockIds) -> BlockPairs:
    """Tail-align without WIN-1: what a connector that never clips would send (ALIGN-1).

    Both tables are fresh contiguous allocations from block 1, so no id is null (NULL-1).
    """
    if len(consumer_block_ids) == 0:
        return BlockPairs(producer_block_ids=BlockIds([]), consumer_block_ids=BlockIds([]))
    producer = [p[len(p) - len(c) :] for p, c in zip(producer_block_ids, consumer_block_ids, strict=True)]
    return BlockPairs(producer_block_ids=BlockIds(producer), consumer_block_ids=consumer_block_ids)


# --------------------------------------------------------------------------- many ranks (PAR-1 .. PAR-7)


def _to_copies(value: Sequence[RankCopy]) -> tuple[RankCopy, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class RankRead:
    """What one consumer rank reads from one producer rank for one group: the same copies in every paired page.

    ``copies`` are offsets within one page of each side (PAR-3); they repeat
    for each of ``num_layers * pages`` consumer pages (PLAN-1), so the bytes are
    ``num_layers * pages * bytes_per_page``. Under consumer DCP a consumer page
    gathers tokens from ``consumer_dcp`` producer pages (``RankCopy.producer_page``, PAR-8).
    """

    group_index: int
    kind: str
    producer_stage: int
    producer_rank: int
    consumer_rank: int
    consumer_dcp_rank: int = 0
    num_layers: int
    pages: int
    copies: tuple[RankCopy, ...] = attrs.field(converter=_to_copies)

    @property
    def bytes_per_page(self) -> int:
        """Bytes read per paired page."""
        return sum(copy.nbytes for copy in self.copies)

    @property
    def nbytes(self) -> int:
        """Bytes read over the request."""
        return self.num_layers * self.pages * self.bytes_per_page

    @property
    def descriptors(self) -> int:
        """Copies over the request: one per run of a page, merged within the page (PAR-3)."""
        return self.num_layers * self.pages * len(self.copies)


def _to_reads(value: Sequence[RankRead]) -> tuple[RankRead, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ParallelPlanSummary:
    """Per consumer rank, what it reads from which producer rank, and each producer rank's completion count."""

    producer_tp: int
    consumer_tp: int
    producer_pp: int
    consumer_dcp: int = 1
    dcp_interleave: int = 1
    base: PlanSummary
    reads: tuple[RankRead, ...] = attrs.field(converter=_to_reads)

    def completion_count(self, producer_rank: int) -> int:
        """Notifications a producer rank (of any stage) waits for before freeing the request (PAR-6)."""
        return get_completion_count(
            producer_tp=self.producer_tp,
            consumer_tp=self.consumer_tp,
            producer_rank=producer_rank,
            consumer_dcp=self.consumer_dcp,
        )

    def notified_ranks(self, consumer_rank: int) -> tuple[int, ...]:
        """The producer TP ranks (in every stage) a consumer rank notifies when done (PAR-6)."""
        return get_candidate_ranks(
            producer_tp=self.producer_tp, consumer_tp=self.consumer_tp, consumer_rank=consumer_rank
        )


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0), name


def get_stage_bands(config: KVCacheConfig, stages: int) -> tuple[tuple[str, ...], ...]:
    """The layer names each of ``stages`` PP stages holds: contiguous bands of the config's layers in order.

    Layers are ordered by their index in the name (``model.layers.{i}...``),
    then by name; stage ``s`` holds ``[s * L // S, (s + 1) * L // S)`` (PAR-7).
    """
    names = sorted((name for group in config.kv_cache_groups for name in group.layer_names), key=_layer_order)
    return tuple(tuple(names[s * len(names) // stages : (s + 1) * len(names) // stages]) for s in range(stages))


@functools.lru_cache(maxsize=4096)
def _rank_copies(
    page: CanonicalPage, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> tuple[tuple[int, tuple[RankCopy, ...]], ...]:
    """A consumer rank's copies of one page, grouped by source rank in rank order; the same for every request.

    They depend on the page and the two layouts only, so an engine plans them
    once per peer, not per request (PAR-3, PAR-4); a refusal is not cached.
    """
    copies = compute_rank_copies(page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank)
    by_source: dict[int, list[RankCopy]] = {}
    for copy in copies:
        by_source.setdefault(copy.producer_rank, []).append(copy)
    return tuple((rank, tuple(by_source[rank])) for rank in sorted(by_source))


def summarize_parallel_plan(
    config: KVCacheConfig,
    pages: Sequence[CanonicalPage],
    *,
    num_tokens: int,
    producer_tp: int,
    consumer_tp: int,
    producer_pp: int = 1,
    consumer_dcp: int = 1,
    dcp_interleave: int = 1,
    prefix_hit_tokens: int = 0,
    mode: TransferMode = TransferMode.READ,
) -> ParallelPlanSummary:
    """What each consumer rank reads from which producer rank for one request (PAR-1 .. PAR-8, CLIP-1, PLAN-1).

    ``pages[g]`` is group ``g``'s canonical page. The pages paired per group
    are those of :func:`summarize_plan` (clipped, one slot per state group);
    each paired page moves the copies of :func:`kvspec.spec.parallel.compute_rank_copies`
    for every consumer rank, from the producer stage that holds its layer (PAR-7).
    With ``consumer_dcp`` > 1 each DCP rank's page gathers its interleaved
    tokens from ``consumer_dcp`` producer pages (:func:`kvspec.spec.parallel.compute_dcp_copies`),
    so a group with token rows has ``cdiv(pages, consumer_dcp)`` consumer pages,
    the last counted whole (PAR-8).
    """
    base = summarize_plan(config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens, mode=mode)
    everything = tuple(name for group in config.kv_cache_groups for name in group.layer_names)
    stage_pairs = pair_stage_layers(get_stage_bands(config, producer_pp), [everything])
    stage_of = {layer: pair.producer_stage for pair in stage_pairs for layer in pair.layers}
    # Layers of each group per producer stage, and each group's consumer pages: the same for every consumer rank.
    layers_of = [
        [sum(stage_of[name] == stage for name in group.layer_names) for stage in range(producer_pp)]
        for group in config.kv_cache_groups
    ]
    reads = []
    for consumer_rank, dcp_rank in itertools.product(range(consumer_tp), range(consumer_dcp)):
        for layer_counts, page, summary in zip(layers_of, pages, base.groups, strict=True):
            if consumer_dcp > 1:
                dcp_copies = compute_dcp_copies(
                    page,
                    producer_tp=producer_tp,
                    consumer_tp=consumer_tp,
                    consumer_rank=consumer_rank,
                    dcp_size=consumer_dcp,
                    dcp_rank=dcp_rank,
                    interleave=dcp_interleave,
                )
                grouped: dict[int, list[RankCopy]] = {}
                for copy in dcp_copies:
                    grouped.setdefault(copy.producer_rank, []).append(copy)
                by_source = {rank: tuple(grouped[rank]) for rank in sorted(grouped)}
            else:
                by_source = dict(_rank_copies(page, producer_tp, consumer_tp, consumer_rank))
            tokens = any(tensor.token_rows for tensor in page.tensors)
            consumer_pages = -(-summary.blocks_clipped // consumer_dcp) if tokens else summary.blocks_clipped
            if not consumer_pages:
                continue  # planned all the same: a layout that cannot be sliced is refused for every group (PAR-5)
            for stage, layers in enumerate(layer_counts):
                if not layers:
                    continue
                reads += [
                    RankRead(
                        group_index=summary.group_index,
                        kind=summary.kind,
                        producer_stage=stage,
                        producer_rank=producer_rank,
                        consumer_rank=consumer_rank,
                        consumer_dcp_rank=dcp_rank,
                        num_layers=layers,
                        pages=consumer_pages,
                        copies=copies,
                    )
                    for producer_rank, copies in by_source.items()
                ]
    return ParallelPlanSummary(
        producer_tp=producer_tp,
        consumer_tp=consumer_tp,
        producer_pp=producer_pp,
        consumer_dcp=consumer_dcp,
        dcp_interleave=dcp_interleave,
        base=base,
        reads=reads,
    )
