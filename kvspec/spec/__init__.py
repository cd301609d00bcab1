"""The normative definitions of kvspec's rules, as plain functions a reader follows in one pass.

Each function here is the definition a rule id names; kvspec's public functions
either are these functions or are tested equal to them (tests/test_fast_paths.py).
This package imports only kvspec's models and errors (docs/explanation/layers.md).
"""

from __future__ import annotations

from kvspec.spec.admission import check_hybrid_support, is_full_attention_spec, is_hma_required
from kvspec.spec.coverage import (
    check_window_coverage,
    get_block_ends,
    get_checked_block_ends,
    get_logical_block_count,
    get_needed_block_range,
    get_needed_token_range,
    get_num_skipped_tokens,
    get_pruned_block_ids,
)
from kvspec.spec.offload import check_offload_support, get_offload_hit_tokens
from kvspec.spec.pairing import BlockPairs, compute_block_pairs, compute_transfer_pairs
from kvspec.spec.plan import BlockPairsLike, PageCopy, compute_page_copies, get_page_byte_ranges
from kvspec.spec.state import (
    STATE_FIELDS,
    STATE_KINDS,
    check_state_position,
    check_state_prefix_hit,
    get_scratch_slot_count,
    get_state_clipped_blocks,
    get_state_clipped_slots,
    get_state_differences,
    get_state_group_indices,
    get_state_paired_lists,
    get_state_prefix_hit,
    is_state_spec,
    pair_state_slots,
)
from kvspec.spec.window import (
    BlockIdsLike,
    TokenBasis,
    get_block_budget,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
    get_token_basis_group,
)

__all__ = [
    "STATE_FIELDS",
    "STATE_KINDS",
    "BlockIdsLike",
    "BlockPairs",
    "BlockPairsLike",
    "PageCopy",
    "TokenBasis",
    "check_hybrid_support",
    "check_offload_support",
    "check_state_position",
    "check_state_prefix_hit",
    "check_window_coverage",
    "compute_block_pairs",
    "compute_page_copies",
    "compute_transfer_pairs",
    "get_block_budget",
    "get_block_ends",
    "get_blocks_per_sw",
    "get_checked_block_ends",
    "get_exchange_clipped_blocks",
    "get_logical_block_count",
    "get_needed_block_range",
    "get_needed_token_range",
    "get_num_skipped_tokens",
    "get_offload_hit_tokens",
    "get_page_byte_ranges",
    "get_pruned_block_ids",
    "get_scratch_slot_count",
    "get_state_clipped_blocks",
    "get_state_clipped_slots",
    "get_state_differences",
    "get_state_group_indices",
    "get_state_paired_lists",
    "get_state_prefix_hit",
    "get_token_basis_group",
    "is_full_attention_spec",
    "is_hma_required",
    "is_state_spec",
    "pair_state_slots",
]
