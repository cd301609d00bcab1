"""The public types as a type checker sees them: ``assert_type`` pins each one (mypy --strict runs over tests/).

At run time ``assert_type`` returns its argument, so these tests also check
that the calls work; under mypy, a changed signature or return type fails here
first, where a user of the API would notice it.
"""

from __future__ import annotations

from typing_extensions import assert_type

import kvspec
from kvspec import (
    BlockIds,
    BlockLists,
    BlockPairs,
    Completion,
    FailureReason,
    KVCacheConfig,
    Message,
    TokenBasis,
    TransferMode,
    TransferPlan,
    TransportError,
)
from kvspec.presets import ModelPreset, get_preset
from kvspec.rules import Rule, get_rule
from kvspec.summary import PlanSummary, summarize_plan
from kvspec.testing import ExpectedLoad, ExpectedPair, expected_pairs
from kvspec.transport import Descriptor, DescriptorList, check_descriptors, merge_runs


def _config() -> KVCacheConfig:
    preset = get_preset("gemma-3-27b")
    assert_type(preset, ModelPreset)
    return assert_type(preset.build_config(num_blocks=64, max_layers_per_group=1, head_size_divisor=64), KVCacheConfig)


def test_reference_functions() -> None:
    config = _config()
    budgets = assert_type(kvspec.get_blocks_per_sw(config), tuple[int, ...])
    assert_type(kvspec.is_hma_required(config), bool)
    assert_type(kvspec.check_hybrid_support(config, mode=TransferMode.READ), None)
    table = BlockIds([range(1, 8)] * config.num_groups)
    clipped = assert_type(kvspec.get_exchange_clipped_blocks(table, budgets), BlockIds)
    assert_type(clipped[0], tuple[int, ...])
    spec = config.kv_cache_groups[0].kv_cache_spec
    assert_type(kvspec.get_logical_block_count(spec, num_tokens=100), int)
    assert_type(kvspec.get_num_skipped_tokens(spec, num_computed_tokens=100), int)
    assert_type(kvspec.get_needed_token_range(spec, num_tokens=100, prefix_hit_tokens=0), range)
    assert_type(kvspec.get_token_basis_group(config), TokenBasis | None)
    counts = assert_type(kvspec.get_consumer_block_counts(config, num_tokens=100, prefix_hit_tokens=0), tuple[int, ...])
    pairs = kvspec.compute_block_pairs(BlockLists(producer_block_ids=clipped, consumer_block_ids=clipped))
    assert_type(pairs, BlockPairs)
    assert_type(pairs.iter_pairs().__next__(), tuple[int, int, int])
    assert len(counts) == config.num_groups


def test_planner_and_descriptors() -> None:
    config = _config()
    ids = BlockIds([[1, 2]] * config.num_groups)
    pairs = kvspec.compute_block_pairs(BlockLists(producer_block_ids=ids, consumer_block_ids=ids))
    plan = assert_type(kvspec.plan_transfer(producer_config=config, consumer_config=config, pairs=pairs), TransferPlan)
    table = assert_type(plan.to_descriptors(TransferMode.READ), DescriptorList)
    assert_type(table[0], Descriptor)
    assert_type(table[0:1], DescriptorList)
    sizes = [t.size for t in config.kv_cache_tensors]
    assert_type(check_descriptors(table, local_sizes=sizes, remote_sizes=sizes), DescriptorList)
    assert_type(merge_runs(table), DescriptorList)
    assert_type(summarize_plan(config, num_tokens=100), PlanSummary)


def test_messages_errors_and_registry() -> None:
    message = assert_type(kvspec.decode(kvspec.encode(Completion(request_id="r", producer_engine_id="p"))), Message)
    assert isinstance(message, Completion)
    error = TransportError("gone", reason="peer_disconnected")
    assert_type(error.reason, FailureReason)
    assert error.reason is FailureReason.PEER_DISCONNECTED
    assert_type(get_rule("CLIP-1"), Rule)


def test_testing_helpers() -> None:
    config = _config()
    load = ExpectedLoad(
        producer_block_ids=[[1, 2]] * config.num_groups, consumer_block_ids=[[3, 4]] * config.num_groups, num_tokens=32
    )
    pairs = assert_type(expected_pairs(config, load), list[ExpectedPair])
    assert pairs
