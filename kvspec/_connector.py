"""The connector seam: the block logic a connector computes before it posts, replaceable for testing.

It sits above the reference functions and the planner and below the driver
core (:mod:`kvspec._driver`), which calls it; the conformance suite plugs a
connector under test in here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvspec._enums import TransferMode
from kvspec._handshake import check_compatibility
from kvspec._messages import EngineDescriptor
from kvspec._models import BlockIds, KVCacheConfig
from kvspec._plan import BlockPairsLike, TransferPlan, plan_transfer
from kvspec._reference import (
    check_hybrid_support,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
)

__all__ = ["Connector", "ReferenceConnector"]


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
        """Clip one side's list before it is exchanged (CLIP-1)."""
        ...

    def pair_block_ids(
        self,
        config: KVCacheConfig,
        *,
        num_tokens: int,
        prefix_hit_tokens: int,
        producer_block_ids: BlockIds,
        consumer_block_ids: BlockIds,
    ) -> BlockPairsLike:
        """Check window coverage, then pair the clipped lists (WIN-1, ALIGN-1, NULL-1)."""
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
        """``get_exchange_clipped_blocks(block_ids, get_blocks_per_sw(config))`` (CLIP-1)."""
        return get_exchange_clipped_blocks(block_ids, get_blocks_per_sw(config))

    def pair_block_ids(
        self,
        config: KVCacheConfig,
        *,
        num_tokens: int,
        prefix_hit_tokens: int,
        producer_block_ids: BlockIds,
        consumer_block_ids: BlockIds,
    ) -> BlockPairsLike:
        """``compute_transfer_pairs`` (WIN-1, ALIGN-1, NULL-1)."""
        return compute_transfer_pairs(
            config,
            num_tokens=num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            producer_block_ids=producer_block_ids,
            consumer_block_ids=consumer_block_ids,
        )

    def plan(
        self, *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
    ) -> TransferPlan:
        """``plan_transfer`` (PLAN-1)."""
        return plan_transfer(producer_config=producer_config, consumer_config=consumer_config, pairs=pairs)

    def __repr__(self) -> str:
        return "ReferenceConnector()"
