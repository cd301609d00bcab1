"""Tests of the transfer planner against a naive page-by-page copy (PLAN-1, NULL-1)."""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvspec import (
    BlockIds,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    PlanError,
    TransferMode,
)
from kvspec.presets import Layout, get_preset
from kvspec.protocol._plan import PageCopy, TransferPlan, plan_transfer
from kvspec.spec import compute_page_copies, get_page_byte_ranges

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


# --------------------------------------------------------------------------- state groups: state bytes, never padding


def fa_mamba2_config(num_blocks: int = 8, ssm_shape: tuple[int, ...] = (2, 2, 3)) -> KVCacheConfig:
    """FA (one layer) + a Mamba-2 state group (two layers): conv (4, 3) fp16 = 24 B, SSM (2, 2, 3) fp32 = 48 B,
    padded to the attention page of 96 B (6 tokens x 1 head x (4 + 4) x 2 B), blocks_first."""
    fa = FullAttentionSpec(block_size=6, num_kv_heads=1, head_size=4, dtype="float16")
    state = MambaSpec(block_size=6, shapes=[(4, 3), ssm_shape], dtypes=["float16", "float32"], page_size_padded=96)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * 96, layers=["fa0"], layer_stride=96, block_stride=96),
            KVCacheTensor(size=num_blocks * 192, layers=["m0", "m1"], layer_stride=96, block_stride=192),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["fa0"], kv_cache_spec=fa),
            KVCacheGroupSpec(layer_names=["m0", "m1"], kv_cache_spec=state),
        ],
    )


def test_a_state_slot_moves_each_state_tensor_and_never_the_padding() -> None:
    """Conv at page offset 0 (24 B), SSM right after it (48 B): 72 of the page's 96 bytes move (PLAN-1)."""
    config = fa_mamba2_config()
    assert get_page_byte_ranges(config.kv_cache_groups[1].kv_cache_spec) == ((0, 24), (24, 48))
    pairs = Pairs(producer_block_ids=BlockIds([[1, 2], [5]]), consumer_block_ids=BlockIds([[3, 4], [2]]))
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    assert [attrs.astuple(c) for c in plan.copies] == [
        (0, 96, 0, 288, 192),  # FA blocks 1, 2 -> 3, 4: whole pages, one run
        (1, 5 * 192, 1, 2 * 192, 72),  # layer m0 of state slot 5 -> 2: conv + SSM, merged; padding stays
        (1, 5 * 192 + 96, 1, 2 * 192 + 96, 72),  # layer m1
    ]
    assert plan.copies == compute_page_copies(producer_config=config, consumer_config=config, pairs=pairs)
    state = plan.groups[1]
    assert (state.page_size, state.moved_per_page, state.nbytes) == (96, 72, 2 * 72)
    assert plan.total_bytes == 192 + 144


def test_state_bytes_land_byte_exact_and_the_consumers_padding_is_untouched() -> None:
    config = fa_mamba2_config()
    pairs = Pairs(producer_block_ids=BlockIds([[], [5]]), consumer_block_ids=BlockIds([[], [2]]))
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    src, dst = fill(config, 1), fill(config, 2)
    before = [bytes(b) for b in dst]
    apply(plan, src, dst)
    for layer in ("m0", "m1"):
        (pr, po), (cr, co) = config.page_offset(layer, 5), config.page_offset(layer, 2)
        assert dst[cr][co : co + 72] == src[pr][po : po + 72]
        assert dst[cr][co + 72 : co + 96] == before[cr][co + 72 : co + 96]  # the 24 bytes of padding
    changed = sum(a != b for region, old in zip(dst, before, strict=True) for a, b in zip(region, old, strict=True))
    assert changed <= 2 * 72


def test_state_tensors_laid_out_differently_are_refused() -> None:
    """Same padded page, other SSM shape: the bytes would land in the wrong tensor (STATE-5)."""
    producer = fa_mamba2_config()
    consumer = fa_mamba2_config(ssm_shape=(3, 2, 2))  # same 48 B, same ranges: accepted
    pairs = Pairs(producer_block_ids=BlockIds([[1], [2]]), consumer_block_ids=BlockIds([[1], [2]]))
    plan_transfer(producer_config=producer, consumer_config=consumer, pairs=pairs)
    consumer = fa_mamba2_config(ssm_shape=(2, 2, 4))  # 64 B: ranges differ
    with pytest.raises(PlanError, match=r"group 1: state tensor byte ranges differ.*\(STATE-5\)"):
        plan_transfer(producer_config=producer, consumer_config=consumer, pairs=pairs)
    with pytest.raises(PlanError, match=r"state tensor byte ranges differ"):
        compute_page_copies(producer_config=producer, consumer_config=consumer, pairs=pairs)
