"""Tests of the transfer planner against a naive page-by-page copy (PLAN-1, NULL-1)."""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvspec import BlockIds, KVCacheConfig, PlanError, TransferMode
from kvspec._plan import PageCopy, TransferPlan, plan_transfer
from kvspec.presets import Layout, get_preset

LAYOUTS = ("blocks_first", "layers_first", "per_layer", "shared")
# Presets with several groups and different kinds; shrunk to a few KiB per pool.
MODELS = ("gemma-3-27b", "gpt-oss-20b", "llama-3.1-8b", "gemma-4-31b")


@attrs.frozen(kw_only=True)
class Pairs:
    """Stand-in for ``BlockPairs``: equal per-group lengths, nulls already dropped."""

    producer_block_ids: BlockIds
    consumer_block_ids: BlockIds


def small_config(model: str, layout: Layout, num_blocks: int) -> KVCacheConfig:
    return get_preset(model).build_config(
        num_blocks=num_blocks, layout=layout, max_layers_per_group=2, head_size_divisor=64, block_size=2
    )


def random_pairs(rng: random.Random, producer: KVCacheConfig, consumer: KVCacheConfig, fill: float) -> Pairs:
    """Distinct real ids over all groups on each side (one block pool, as vLLM allocates)."""
    num_groups = producer.num_groups
    budget = min(producer.num_blocks, consumer.num_blocks) - 1
    per_group = [rng.randint(0, int(budget * fill) // num_groups) for _ in range(num_groups)]
    producer_ids = rng.sample(range(1, producer.num_blocks), sum(per_group))
    consumer_ids = rng.sample(range(1, consumer.num_blocks), sum(per_group))
    p_groups, c_groups, start = [], [], 0
    for n in per_group:
        p_groups.append(producer_ids[start : start + n])
        c_groups.append(consumer_ids[start : start + n])
        start += n
    return Pairs(producer_block_ids=BlockIds(p_groups), consumer_block_ids=BlockIds(c_groups))


def fill(config: KVCacheConfig, seed: int) -> list[bytearray]:
    rng = random.Random(seed)
    return [bytearray(rng.randbytes(t.size)) for t in config.kv_cache_tensors]


def naive_copy(
    producer: KVCacheConfig, consumer: KVCacheConfig, pairs: Pairs, src: list[bytearray], dst: list[bytearray]
) -> None:
    """One page per (layer, pair), straight from the PLAN-1 layout formula."""
    for g, group in enumerate(producer.kv_cache_groups):
        if not len(pairs.producer_block_ids):
            return
        page = group.kv_cache_spec.page_size_bytes
        for layer in group.layer_names:
            for p_id, c_id in zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True):
                pr, po = producer.page_offset(layer, p_id)
                cr, co = consumer.page_offset(layer, c_id)
                dst[cr][co : co + page] = src[pr][po : po + page]


def apply(plan: TransferPlan, src: list[bytearray], dst: list[bytearray]) -> None:
    for c in plan.copies:
        dst[c.consumer_region][c.consumer_offset : c.consumer_offset + c.nbytes] = src[c.producer_region][
            c.producer_offset : c.producer_offset + c.nbytes
        ]


def count_maximal_runs(pages: list[PageCopy]) -> int:
    """Pages that no other page continues on both sides start a run."""
    ends = {
        (p.producer_region, p.producer_offset + p.nbytes, p.consumer_region, p.consumer_offset + p.nbytes)
        for p in pages
    }
    return sum(
        1 for p in pages if (p.producer_region, p.producer_offset, p.consumer_region, p.consumer_offset) not in ends
    )


def unmerged_pages(producer: KVCacheConfig, consumer: KVCacheConfig, pairs: Pairs) -> list[PageCopy]:
    pages = []
    for g, group in enumerate(producer.kv_cache_groups):
        if not len(pairs.producer_block_ids):
            break
        page = group.kv_cache_spec.page_size_bytes
        for layer in group.layer_names:
            for p_id, c_id in zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True):
                pr, po = producer.page_offset(layer, p_id)
                cr, co = consumer.page_offset(layer, c_id)
                pages.append(
                    PageCopy(
                        producer_region=pr, producer_offset=po, consumer_region=cr, consumer_offset=co, nbytes=page
                    )
                )
    return pages


@given(
    model=st.sampled_from(MODELS),
    producer_layout=st.sampled_from(LAYOUTS),
    consumer_layout=st.sampled_from(LAYOUTS),
    producer_blocks=st.integers(2, 40),
    consumer_blocks=st.integers(2, 40),
    density=st.sampled_from([0.2, 0.6, 1.0]),
    seed=st.integers(0, 2**32),
)
@example(
    model="gemma-3-27b", producer_layout="layers_first", consumer_layout="layers_first",
    producer_blocks=9, consumer_blocks=9, density=1.0, seed=0,
)  # fmt: skip
def test_plan_moves_exactly_the_paired_pages(
    model: str,
    producer_layout: Layout,
    consumer_layout: Layout,
    producer_blocks: int,
    consumer_blocks: int,
    density: float,
    seed: int,
) -> None:
    """The plan's copies equal a naive page-by-page copy, byte for byte, and nothing else (PLAN-1)."""
    producer = small_config(model, producer_layout, producer_blocks)
    consumer = small_config(model, consumer_layout, consumer_blocks)
    rng = random.Random(seed)
    pairs = random_pairs(rng, producer, consumer, density)
    plan = plan_transfer(producer_config=producer, consumer_config=consumer, pairs=pairs)

    src = fill(producer, seed)
    src_before = [bytes(b) for b in src]
    expected, got = fill(consumer, seed + 1), fill(consumer, seed + 1)
    naive_copy(producer, consumer, pairs, src, expected)
    apply(plan, src, got)

    assert got == expected
    assert [bytes(b) for b in src] == src_before
    pages = unmerged_pages(producer, consumer, pairs)
    assert plan.total_bytes == sum(p.nbytes for p in pages)
    assert plan.num_pages == len(pages)
    assert plan.num_descriptors == count_maximal_runs(pages)
    assert all(c.nbytes > 0 for c in plan.copies)


def test_contiguous_runs_merge_into_one_descriptor_per_layer() -> None:
    config = small_config("llama-3.1-8b", "layers_first", 16)
    pairs = Pairs(producer_block_ids=BlockIds([[3, 4, 5, 6]]), consumer_block_ids=BlockIds([[10, 11, 12, 13]]))
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    layers = len(config.kv_cache_groups[0].layer_names)
    assert plan.num_descriptors == layers
    assert plan.total_bytes == 4 * layers * config.kv_cache_groups[0].kv_cache_spec.page_size_bytes


def test_run_broken_on_one_side_splits() -> None:
    config = small_config("llama-3.1-8b", "layers_first", 16)
    pairs = Pairs(producer_block_ids=BlockIds([[3, 4, 5]]), consumer_block_ids=BlockIds([[10, 11, 13]]))
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    assert plan.num_descriptors == 2 * len(config.kv_cache_groups[0].layer_names)


def test_zero_groups_is_an_empty_plan() -> None:
    config = small_config("gemma-3-27b", "blocks_first", 8)
    plan = plan_transfer(
        producer_config=config,
        consumer_config=config,
        pairs=Pairs(producer_block_ids=BlockIds([]), consumer_block_ids=BlockIds([])),
    )
    assert plan.num_descriptors == 0
    assert plan.total_bytes == 0


@pytest.mark.parametrize(
    ("producer_ids", "consumer_ids", "match"),
    [
        ([[8]], [[1]], "producer group 0 position 0: block id 8"),
        ([[1]], [[8]], "consumer group 0 position 0: block id 8"),
        ([[0]], [[1]], "null block"),
        ([[1]], [[0]], "null block"),
        ([[1, 2]], [[3]], "2 producer ids paired with 1"),
        ([[1, 2]], [[3, 3]], "overlap"),
    ],
)
def test_bad_pairs_raise_plan_error_before_anything(
    producer_ids: list[list[int]], consumer_ids: list[list[int]], match: str
) -> None:
    config = small_config("llama-3.1-8b", "per_layer", 8)
    pairs = Pairs(producer_block_ids=BlockIds(producer_ids), consumer_block_ids=BlockIds(consumer_ids))
    with pytest.raises(PlanError, match=match):
        plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)


def test_group_count_mismatch_is_a_plan_error() -> None:
    config = small_config("gemma-3-27b", "blocks_first", 8)
    pairs = Pairs(producer_block_ids=BlockIds([[1]]), consumer_block_ids=BlockIds([[1]]))
    with pytest.raises(PlanError, match="groups"):
        plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)


def test_different_layers_or_page_sizes_are_refused() -> None:
    preset = get_preset("gpt-oss-20b")
    base = preset.build_config(num_blocks=8, max_layers_per_group=2, head_size_divisor=64, block_size=2)
    fewer_layers = preset.build_config(num_blocks=8, max_layers_per_group=1, head_size_divisor=64, block_size=2)
    bigger_pages = preset.build_config(num_blocks=8, max_layers_per_group=2, head_size_divisor=32, block_size=2)
    ids = BlockIds([[1], [2]])
    pairs = Pairs(producer_block_ids=ids, consumer_block_ids=ids)
    with pytest.raises(PlanError, match="layer names differ"):
        plan_transfer(producer_config=base, consumer_config=fewer_layers, pairs=pairs)
    with pytest.raises(PlanError, match="page size differs"):
        plan_transfer(producer_config=base, consumer_config=bigger_pages, pairs=pairs)


def test_to_descriptors_maps_roles_to_initiator() -> None:
    copy = PageCopy(producer_region=1, producer_offset=100, consumer_region=2, consumer_offset=200, nbytes=8)
    plan = TransferPlan(copies=[copy], groups=[])
    (read,) = plan.to_descriptors(TransferMode.READ)
    (write,) = plan.to_descriptors(TransferMode.WRITE)
    # READ: the consumer posts; WRITE: the producer posts (ADM-2).
    assert (read.local_region, read.local_offset, read.remote_region, read.remote_offset) == (2, 200, 1, 100)
    assert (write.local_region, write.local_offset, write.remote_region, write.remote_offset) == (1, 100, 2, 200)
    assert read.nbytes == write.nbytes == 8
