"""The offload connector seam: the reference hooks are the reference functions, and lookup falls back to them."""

from __future__ import annotations

from kvspec.drivers._connector import (
    OffloadConnector,
    ReferenceConnector,
    ReferenceOffloadConnector,
    as_offload_connector,
)
from kvspec.presets import get_preset
from kvspec.reference._offload import OffloadConfig, get_load_set, get_offload_hit_tokens, get_store_set


class _Custom(ReferenceConnector, ReferenceOffloadConnector):
    """A connector bringing both exchange and offload hooks."""


def test_lookup_prefers_the_connectors_own_offload_hooks() -> None:
    custom = _Custom()
    assert as_offload_connector(custom) is custom
    assert isinstance(custom, OffloadConnector)


def test_lookup_falls_back_to_the_reference() -> None:
    found = as_offload_connector(ReferenceConnector())
    assert type(found) is ReferenceOffloadConnector
    assert not isinstance(ReferenceConnector(), OffloadConnector)


def test_reference_hooks_return_what_the_reference_functions_return() -> None:
    config = get_preset("gemma-3-1b").build_config(num_blocks=64)
    offload = OffloadConfig(blocks_per_chunk=2, hash_block_size=config.kv_cache_groups[0].kv_cache_spec.block_size)
    sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
    block_ids = [list(range(1, 9)) for _ in sizes]
    tokens = 8 * min(sizes)
    hooks = ReferenceOffloadConnector()
    store = hooks.get_store_set(
        config, block_ids, request_id="r", num_offloadable_tokens=tokens, next_chunk=[0] * len(sizes), offload=offload
    )
    assert store == get_store_set(
        config, block_ids, num_offloadable_tokens=tokens, next_chunk=[0] * len(sizes), offload=offload
    )
    present = [[True] * store.chunk_ranges[g][1] for g in range(len(sizes))]
    hit = hooks.get_offload_hit_tokens(
        config, present, request_id="r", num_tokens=tokens, local_hit_tokens=0, offload=offload
    )
    assert hit == get_offload_hit_tokens(config, present, num_tokens=tokens, local_hit_tokens=0, offload=offload)
    assert hit > 0
    load = hooks.get_load_set(config, block_ids, request_id="r", num_tokens=hit, local_hit_tokens=0, offload=offload)
    assert load == get_load_set(config, block_ids, num_tokens=hit, local_hit_tokens=0, offload=offload)
    assert hooks.map_sub_blocks(4, 3, blocks_per_chunk=3) == ((0, 1), (0, 2), (1, 0))
    hooks.finish_request("r")
