"""The connector seam: the block logic a connector computes before it posts, replaceable for testing.

It sits above the reference functions and the planner and below the driver
core (:mod:`kvspec.drivers._driver`), which calls it; the conformance suite plugs a
connector under test in here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from kvspec.core._deprecation import warn_renamed
from kvspec.core._enums import TransferMode
from kvspec.core._errors import ParallelismError
from kvspec.core._models import BlockIds, KVCacheConfig
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._plan import BlockPairsLike, TransferPlan, plan_transfer
from kvspec.reference._messages import EngineDescriptor
from kvspec.reference._offload import (
    BlockIdGroups,
    LoadSet,
    OffloadConfig,
    StoreSet,
    get_load_set,
    get_offload_hit_tokens,
    get_store_set,
    map_sub_blocks,
)
from kvspec.reference._reference import (
    check_hybrid_support,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
)
from kvspec.spec import parallel as par
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.parallel import CanonicalPage, RankCopy
from kvspec.spec.state import get_state_clipped_blocks

__all__ = [
    "Connector",
    "ConsumerRankPlan",
    "OffloadConnector",
    "ParallelConnector",
    "ReferenceConnector",
    "ReferenceOffloadConnector",
    "ReferenceParallelConnector",
    "as_offload_connector",
    "as_parallel_connector",
    "pair_keywords",
    "pair_with",
    "takes_keywords",
]


@runtime_checkable
class Connector(Protocol):
    """What a KV connector decides between the engines' block tables and the transport.

    The suite drives every scenario through these hooks, and its oracle
    checks where each page landed by logical position, independently of them.
    A connector author plugs their own logic in (``kvspec conform BACKEND
    --connector module:factory`` or ``BackendSuite.connector_factory``) to have
    their clipping, alignment and planning checked; the default is
    :class:`ReferenceConnector`, kvspec's reference functions.
    """

    def check_admission(self, config: KVCacheConfig, mode: TransferMode) -> None:
        """Refuse, before anything is set up, a config the exchange does not admit (HMA-1, ADM-1, ADM-2)."""
        ...

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        """Refuse an incompatible peer at handshake, listing every difference (HS-1)."""
        ...

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        """Clip one side's list before it is exchanged: windows to budget, state to one slot (CLIP-1, STATE-2)."""
        ...

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        """Check window coverage, then pair the clipped lists (WIN-1, ALIGN-1, NULL-1).

        ``request`` holds the token counts, both lists and, protocol 1.1, the
        tokens C recomputes and where each side's list ends
        (:class:`kvspec.TransferRequest`).
        """
        ...

    def plan(
        self, *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
    ) -> TransferPlan:
        """Turn pairs into byte copies (PLAN-1)."""
        ...


class ReferenceConnector:
    """The connector logic of the specification itself: kvspec's reference functions."""

    def check_admission(self, config: KVCacheConfig, mode: TransferMode) -> None:
        """``check_hybrid_support(config, mode=mode)`` (ADM-1, ADM-2)."""
        check_hybrid_support(config, mode=mode)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        """``check_compatibility(producer=producer, consumer=consumer)`` (HS-1)."""
        check_compatibility(producer=producer, consumer=consumer)

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        """``get_exchange_clipped_blocks``, then ``get_state_clipped_blocks`` (CLIP-1, STATE-2)."""
        return get_state_clipped_blocks(config, get_exchange_clipped_blocks(block_ids, get_blocks_per_sw(config)))

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        """``compute_transfer_pairs`` (WIN-1, ALIGN-1, NULL-1)."""
        return compute_transfer_pairs(config, request)

    def plan(
        self, *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
    ) -> TransferPlan:
        """``plan_transfer`` (PLAN-1)."""
        return plan_transfer(producer_config=producer_config, consumer_config=consumer_config, pairs=pairs)

    def __repr__(self) -> str:
        return "ReferenceConnector()"


def pair_keywords(request: TransferRequest) -> dict[str, Any]:
    """The keywords of the keyword form of :meth:`Connector.pair_block_ids` (before 0.2.x) for ``request``.

    The protocol 1.0 ones always; the 1.1 ones (``recomputed_tokens``, the
    block ends) only where they say something, so a connector written for
    protocol 1.0 runs every request that does not use them (VER-1, ALIGN-1, WIN-1).
    """
    keywords: dict[str, Any] = {
        "num_tokens": request.num_tokens,
        "prefix_hit_tokens": request.prefix_hit_tokens,
        "producer_block_ids": request.producer_block_ids,
        "consumer_block_ids": request.consumer_block_ids,
    }
    if request.recomputed_tokens:
        keywords["recomputed_tokens"] = request.recomputed_tokens
    if request.producer_block_ends is not None:
        keywords["producer_block_ends"] = request.producer_block_ends
    if request.consumer_block_ends is not None:
        keywords["consumer_block_ends"] = request.consumer_block_ends
    return keywords


def takes_keywords(connector: Connector) -> bool:
    """True for a connector whose ``pair_block_ids`` has the keyword form (``num_tokens=`` ...), not ``request``."""
    method = connector.pair_block_ids
    function = getattr(method, "__func__", method)  # a method's function: one inspection per class
    try:
        return _has_keyword_form(function)
    except TypeError:  # an unhashable callable: inspected each time
        return _has_keyword_form.__wrapped__(function)


@functools.lru_cache(maxsize=256)
def _has_keyword_form(function: Callable[..., Any]) -> bool:
    # pair_with asks on every pairing: inspect.signature costs more than the pairing of a short request.
    parameters = inspect.signature(function).parameters
    return "num_tokens" in parameters and "request" not in parameters


def pair_with(connector: Connector, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
    """``connector.pair_block_ids(config, request)``; the keyword form still runs, deprecated (WIN-1, ALIGN-1).

    A connector written before the request value (``pair_block_ids(config, *,
    num_tokens, prefix_hit_tokens, producer_block_ids, ...)``) gets
    :func:`pair_keywords` and a ``DeprecationWarning``; the form is removed in
    kvspec 0.3.0.
    """
    if not takes_keywords(connector):
        return connector.pair_block_ids(config, request)
    warn_renamed(
        f"{type(connector).__name__}.pair_block_ids(config, *, num_tokens=..., ...)",
        "pair_block_ids(config, request: kvspec.TransferRequest)",
    )
    method: Callable[..., BlockPairsLike] = connector.pair_block_ids
    return method(config, **pair_keywords(request))


@runtime_checkable
class OffloadConnector(Protocol):
    """What an offloading connector decides between the GPU block table and the chunk pool (OFF-3 ... OFF-7).

    The hooks mirror the reference functions of :mod:`kvspec.reference._offload`, with
    the same arguments plus ``request_id`` (keyword-only), so that a stateful
    connector (vLLM's offloading scheduler keeps per-request state) can keep
    one state per request; :meth:`finish_request` tells it the request is
    gone. The suite owns the chunk pool, its keys and its evictions, and its
    oracle checks every stored and loaded page by logical position,
    independently of these hooks. A connector object may implement both
    :class:`Connector` and this protocol; the suite uses
    :func:`as_offload_connector` to find the offload hooks, with the reference
    as default.
    """

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        """The chunks one store step offers and the GPU blocks it copies (OFF-3, OFF-4)."""
        ...

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        """Tokens past the local hit the chunk pool can supply (OFF-5)."""
        ...

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        """The chunks a hit reads and the GPU blocks they land in (OFF-6)."""
        ...

    def map_sub_blocks(
        self, first_block_index: int, num_blocks: int, *, blocks_per_chunk: int
    ) -> tuple[tuple[int, int], ...]:
        """Which (chunk entry, sub-block) each GPU block of a store or load set pairs with (OFF-7)."""
        ...

    def finish_request(self, request_id: str) -> None:
        """The request ended (finished, aborted or preempted); drop any state kept for it."""
        ...


class ReferenceOffloadConnector:
    """The offload logic of the specification itself: kvspec's reference functions, stateless."""

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        """``get_store_set`` (OFF-3, OFF-4)."""
        return get_store_set(
            config, block_ids, num_offloadable_tokens=num_offloadable_tokens, next_chunk=next_chunk, offload=offload
        )

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        """``get_offload_hit_tokens`` (OFF-5)."""
        return get_offload_hit_tokens(
            config, present, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        """``get_load_set`` (OFF-6)."""
        return get_load_set(
            config, block_ids, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )

    def map_sub_blocks(
        self, first_block_index: int, num_blocks: int, *, blocks_per_chunk: int
    ) -> tuple[tuple[int, int], ...]:
        """``map_sub_blocks`` (OFF-7)."""
        return map_sub_blocks(first_block_index, num_blocks, blocks_per_chunk=blocks_per_chunk)

    def finish_request(self, request_id: str) -> None:
        """Nothing to drop: the reference keeps no state."""

    def __repr__(self) -> str:
        return "ReferenceOffloadConnector()"


def as_offload_connector(connector: object) -> OffloadConnector:
    """``connector`` itself when it implements :class:`OffloadConnector`, else the reference (OFF-3 ... OFF-7).

    A connector under test that brings only exchange hooks has its offload
    cases run with the reference offload logic, so they still check the
    backend's copies.
    """
    if isinstance(connector, OffloadConnector):
        return connector
    return ReferenceOffloadConnector()


# --------------------------------------------------------------------------- many ranks (PAR-3, PAR-4, PAR-6)


def _to_copy_lists(value: Sequence[Sequence[RankCopy]]) -> tuple[tuple[RankCopy, ...], ...]:
    return tuple(tuple(copies) for copies in value)


def _to_ranks(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ConsumerRankPlan:
    """What one consumer rank does across ranks: its copies per layer, whom it notifies, what it tells them.

    ``copies[i]`` fills the consumer rank's page of the ``i``-th page given
    (offsets within one page, PLAN-1 repeats them per paired block);
    ``notified`` are the producer TP ranks it notifies once its reads are
    done; ``completion_counts[i]`` is the number of notifications
    ``notified[i]`` waits for before it frees the request's blocks, carried
    in the notification as engines do (PAR-3, PAR-4, PAR-6).
    """

    copies: tuple[tuple[RankCopy, ...], ...] = attrs.field(converter=_to_copy_lists)
    notified: tuple[int, ...] = attrs.field(converter=_to_ranks)
    completion_counts: tuple[int, ...] = attrs.field(converter=_to_ranks)

    @completion_counts.validator
    def _check_counts(self, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
        if len(value) != len(self.notified):
            raise ParallelismError(
                f"ConsumerRankPlan.completion_counts: expected one per notified rank ({len(self.notified)}), "
                f"got {len(value)} (PAR-6)"
            )


@runtime_checkable
class ParallelConnector(Protocol):
    """What a connector decides when the two engines' parallelism differs (PAR-3, PAR-4, PAR-6, PAR-8).

    The suite's ``PAR-*`` cases ask it, per consumer rank, which bytes it reads
    from which producer rank and whom it notifies; their oracle judges the
    bytes against the canonical projection (PAR-2) independently of it. A
    connector that cannot express a case (a layout, a parallelism it does not
    support) raises :class:`NotImplementedError` naming the capability, and
    the case is skipped with that reason. :func:`as_parallel_connector` gives
    kvspec's planner to a connector without this hook.
    """

    def plan_consumer_rank(
        self,
        pages: Sequence[CanonicalPage],
        *,
        producer_tp: int,
        consumer_tp: int,
        consumer_rank: int,
        consumer_dcp: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
        producer_pp: int = 1,
    ) -> ConsumerRankPlan:
        """The copies of consumer rank ``consumer_rank`` (DCP rank ``dcp_rank``) per page, and its notifications.

        ``pages`` are the request's layers in the consumer's order, each at
        TP 1 (PAR-2); with ``producer_pp`` stages the suite pairs the layers
        by name (PAR-7) and the offsets stay within each layer's page.
        """
        ...


class ReferenceParallelConnector:
    """kvspec's own planner behind the parallel seam: ``compute_rank_copies`` (``compute_dcp_copies`` under DCP)."""

    def plan_consumer_rank(
        self,
        pages: Sequence[CanonicalPage],
        *,
        producer_tp: int,
        consumer_tp: int,
        consumer_rank: int,
        consumer_dcp: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
        producer_pp: int = 1,
    ) -> ConsumerRankPlan:
        """Each unit from its elected source; every candidate rank notified; PAR-6's count (PAR-3, PAR-4, PAR-6)."""
        tp = {"producer_tp": producer_tp, "consumer_tp": consumer_tp, "consumer_rank": consumer_rank}
        if consumer_dcp == 1:
            copies = [par.compute_rank_copies(page, **tp) for page in pages]
        else:
            dcp = {"dcp_size": consumer_dcp, "dcp_rank": dcp_rank, "interleave": dcp_interleave}
            copies = [par.compute_dcp_copies(page, **tp, **dcp) for page in pages]
        notified = par.get_candidate_ranks(**tp)
        counts = [
            par.get_completion_count(
                producer_tp=producer_tp, consumer_tp=consumer_tp, producer_rank=rank, consumer_dcp=consumer_dcp
            )
            for rank in notified
        ]
        return ConsumerRankPlan(copies=copies, notified=notified, completion_counts=counts)

    def __repr__(self) -> str:
        return "ReferenceParallelConnector()"


def as_parallel_connector(connector: object) -> ParallelConnector:
    """``connector`` itself when it has the parallel hook, else kvspec's planner (PAR-3, PAR-4, PAR-6).

    An exchange connector without ``plan_consumer_rank`` has its ``PAR-*``
    cases planned by kvspec, so they still check the backend's copies.
    """
    if isinstance(connector, ParallelConnector):
        return connector
    return ReferenceParallelConnector()
