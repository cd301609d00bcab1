"""The fast twins of kvspec.spec's definitions, for an engine's hot path: the same answers and refusals, sooner.

Alternative implementations of the definitions in :mod:`kvspec.spec`, written for
speed rather than clarity (as execution-specs keeps ``ethereum_optimized`` apart
from the spec): whole-list id checks, clipping before checking, null scans skipped
for lists proven null-free. Each is tested equal to its definition, result for
result and error class for error class (tests/test_fast_paths.py).

An engine calls these per request, where its lists are long (about 20 times
faster than the definitions on a 128k-token request); the names of the same
spelling in :mod:`kvspec` are the definitions themselves (``kvspec.X is
kvspec.spec.X``), the text to read for what a rule means.
"""

from kvspec.reference._offload import get_offload_hit_tokens
from kvspec.reference._reference import (
    check_request_blocks,
    check_window_coverage,
    compute_block_pairs,
    compute_transfer_pairs,
    get_exchange_clipped_blocks,
    get_pruned_block_ids,
)

__all__ = [
    "check_request_blocks",
    "check_window_coverage",
    "compute_block_pairs",
    "compute_transfer_pairs",
    "get_exchange_clipped_blocks",
    "get_offload_hit_tokens",
    "get_pruned_block_ids",
]
