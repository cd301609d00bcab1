"""Request tables: the one block allocator and the tables an engine hands a request (WIN-1, CLIP-1, STATE-2).

Only the engine roles (:mod:`kvspec.drivers._engine`) import this module: a
producer's table (pruned as vLLM prunes, with a state group's scratch slots),
a consumer's uncached suffix and where each list ends are decided here, once,
for kvspec's exchange endpoints and the conformance suite's scenarios alike.
A caller that names its block ids (a scenario's case) passes them as a claim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from kvspec.core._errors import ConfigError, LocalProtocolError, OutOfBlocksError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig
from kvspec.reference._reference import get_consumer_block_counts, get_logical_block_count, get_pruned_block_ids
from kvspec.spec.state import get_scratch_slot_count, get_state_group_indices

__all__ = [
    "BlockAllocator",
    "Reuse",
    "get_lookup_table_shape",
    "get_page_ends",
    "get_producer_table_shape",
    "get_suffix_counts",
    "get_whole_table_ends",
]

Reuse = Literal["lowest", "latest"]
"""Which free block an allocator hands out next: the lowest id, or the one freed last."""


class BlockAllocator:
    """A free list over ``1 .. num_blocks - 1``; block 0 is the null block and never allocated (NULL-1).

    ``on_free`` is called with every id list before it is returned to the
    pool, so a test can assert that no transfer still touches them (SM-2).
    ``reuse="lowest"`` keeps fresh allocations contiguous (fewer descriptors);
    ``reuse="latest"`` hands out the block freed last first, so a block freed
    too early is reused at once and a late write into it is seen (SM-2).
    """

    def __init__(
        self, num_blocks: int, *, on_free: Callable[[list[int]], None] | None = None, reuse: Reuse = "lowest"
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"BlockAllocator.num_blocks: expected a positive int, got {num_blocks!r}")
        if reuse not in ("lowest", "latest"):
            raise ConfigError(f"BlockAllocator.reuse: expected 'lowest' or 'latest', got {reuse!r}")
        self.num_blocks = num_blocks
        self.on_free = on_free
        self.reuse = reuse
        # Pop from the end: low ids first.
        self._free = list(range(num_blocks - 1, NULL_BLOCK_ID, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks available, the null block excluded."""
        return len(self._free)

    @property
    def baseline(self) -> int:
        """Blocks available when nothing is allocated: every block but the null block."""
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int]:
        """``count`` distinct real ids, or :class:`OutOfBlocksError` with nothing taken."""
        if count < 0:
            raise ConfigError(f"BlockAllocator.allocate: expected a non-negative count, got {count}")
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} blocks, {len(self._free)} free of {self.num_blocks - 1}")
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def allocate_groups(self, counts: Sequence[int]) -> BlockIds:
        """One list per group, all from the one pool (as vLLM's block pool serves every group)."""
        if sum(counts) > len(self._free):
            raise OutOfBlocksError(f"need {sum(counts)} blocks, {len(self._free)} free of {self.num_blocks - 1}")
        return BlockIds([self.allocate(n) for n in counts])

    def claim(self, block_ids: BlockIds) -> BlockIds:
        """Take the named real ids that are free; one already taken stays shared (a case's own table)."""
        for group in block_ids:
            for block_id in group:
                if block_id != NULL_BLOCK_ID and block_id in self._free:
                    self._free.remove(block_id)
                    self._used.add(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int], *, missing_ok: bool = False) -> None:
        """Return real ids to the pool; null ids are skipped; a double free is a local protocol error.

        With ``missing_ok`` an id that is free already is skipped instead: a
        claimed table may share blocks with another request's.
        """
        ids = [b for b in block_ids if b != NULL_BLOCK_ID]
        if missing_ok:
            ids = list(dict.fromkeys(b for b in ids if b in self._used))
        unknown = [b for b in ids if b not in self._used]
        if unknown or len(set(ids)) != len(ids):
            raise LocalProtocolError(f"BlockAllocator.free: ids not allocated or freed twice: {sorted(unknown)[:8]}")
        if self.on_free is not None:
            self.on_free(ids)
        self._used.difference_update(ids)
        self._free.extend(ids)
        if self.reuse == "lowest":
            self._free.sort(reverse=True)  # keep low ids first for later allocations

    def free_groups(self, block_ids: BlockIds, *, missing_ok: bool = False) -> None:
        """Free every real id of every group."""
        self.free((b for group in block_ids for b in group), missing_ok=missing_ok)


def get_producer_table_shape(config: KVCacheConfig, *, num_tokens: int, recomputed_tokens: int = 0) -> BlockIds:
    """A producer's table after prefill with a placeholder id 1 for every real block (WIN-1, STATE-2).

    The table covers ``T + R`` tokens and is pruned with the ``T`` whose KV
    the consumer takes: positions a window or an earlier state left behind
    hold the null block, as vLLM's ``remove_skipped_blocks`` leaves them; a
    state group's speculative scratch slots sit at its tail (the clip drops
    them) (WIN-1, STATE-2).
    """
    totals = []
    for group in config.kv_cache_groups:
        blocks = get_logical_block_count(group.kv_cache_spec, num_tokens=num_tokens + recomputed_tokens)
        totals.append(blocks + (get_scratch_slot_count(group.kv_cache_spec) if blocks else 0))
    return get_pruned_block_ids(config, BlockIds([[1] * n for n in totals]), num_computed_tokens=num_tokens)


def get_lookup_table_shape(config: KVCacheConfig, *, num_tokens: int, computed_tokens: int) -> BlockIds:
    """An offloading engine's table at lookup for ``N`` tokens, placeholder id 1 per real block (WIN-1, OFF-6).

    Positions a window or an earlier state left behind once ``computed_tokens``
    are computed hold the null block, as vLLM's ``remove_skipped_blocks``
    leaves them; every other position gets a block (WIN-1, OFF-6).
    """
    lengths = [get_logical_block_count(g.kv_cache_spec, num_tokens=num_tokens) for g in config.kv_cache_groups]
    table = BlockIds([[1] * n for n in lengths])
    return get_pruned_block_ids(config, table, num_computed_tokens=computed_tokens)


def get_suffix_counts(
    config: KVCacheConfig, *, num_tokens: int, prefix_hit_tokens: int, recomputed_tokens: int = 0
) -> tuple[int, ...] | None:
    """Blocks per group of a consumer's uncached suffix; ``None`` for a full prefix hit (zero groups, CLIP-1)."""
    if prefix_hit_tokens >= num_tokens:
        return None
    return get_consumer_block_counts(
        config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens, recomputed_tokens=recomputed_tokens
    )


def get_whole_table_ends(config: KVCacheConfig, num_tokens: int) -> tuple[int, ...]:
    """Each group's last block plus one for ``num_tokens`` tokens: where a whole table ends (ALIGN-1, WIN-1)."""
    return tuple(get_logical_block_count(g.kv_cache_spec, num_tokens=num_tokens) for g in config.kv_cache_groups)


def get_page_ends(
    config: KVCacheConfig, table: BlockIds, *, num_tokens: int, declared: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """Where a producer's lists end for keying its pages: a state group's scratch slots sit past its end (STATE-2).

    ``declared`` are the ends the producer declares (``None``: a 1.0 side);
    without state groups they are the answer as they are.
    """
    states = get_state_group_indices(config)
    if not states or len(table) != config.num_groups:
        return declared
    ends = list(declared or get_whole_table_ends(config, num_tokens))
    for g in states:
        scratch = min(get_scratch_slot_count(config.kv_cache_groups[g].kv_cache_spec), len(table[g]) - 1)
        ends[g] += max(scratch, 0)
    return tuple(ends)
