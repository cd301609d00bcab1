"""Tests of kvspec.testing: pools, keyed pages, and that the oracle catches every kind of wrong page."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing import shared_memory

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvspec_conformance.strategies import configs

from kvspec import (
    BlockIds,
    ConfigError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from kvspec.testing import (
    ExpectedLoad,
    MismatchKind,
    PageMismatch,
    PagePool,
    allocate_pool,
    check_pools,
    expected_page,
    expected_pairs,
    fill_background,
    fill_producer_pages,
    logical_positions,
)

PAGE_FA = 4 * 1 * (2 + 2) * 1  # block 4, 1 head, K and V head 2, int8
NUM_BLOCKS = 12


def make_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """Full attention (B=4) and sliding window (W=6, B=4); layers of both groups share tensor 0."""
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="int8")
    sw = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="int8", sliding_window=6)
    stride = 2 * PAGE_FA
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=stride * num_blocks, layers=["fa0", "sw0"], layer_stride=PAGE_FA, block_stride=stride),
            KVCacheTensor(size=PAGE_FA * num_blocks + 8, layers=["fa1"], layer_stride=0, block_stride=PAGE_FA),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["fa0", "fa1"], kv_cache_spec=fa),
            KVCacheGroupSpec(layer_names=["sw0"], kv_cache_spec=sw),
        ],
    )


@pytest.fixture
def pools() -> Iterator[tuple[PagePool, PagePool]]:
    config = make_config()
    with allocate_pool(config) as producer, allocate_pool(config, shared=False) as consumer:
        fill_background(producer, seed="p")
        fill_background(consumer, seed="c")
        yield producer, consumer


# T = 10 tokens: full attention needs blocks 0..2, the window [4, 9] needs blocks 1..2.
P_IDS = BlockIds([[1, 2, 3], [4, 5]])
C_IDS = BlockIds([[7, 8], [9, 10]])  # prefix hit of 4 tokens on C
LOAD = ExpectedLoad(producer_block_ids=P_IDS, consumer_block_ids=C_IDS, num_tokens=10, salt="r1")


def copy_pages(producer: PagePool, consumer: PagePool, pairs: list[tuple[int, int, int]]) -> None:
    for group, p_block, c_block in pairs:
        for layer in producer.config.kv_cache_groups[group].layer_names:
            consumer.page(layer, c_block)[:] = producer.page(layer, p_block)


GOOD = [(0, 2, 7), (0, 3, 8), (1, 4, 9), (1, 5, 10)]


def run(
    producer: PagePool, consumer: PagePool, pairs: list[tuple[int, int, int]], load: ExpectedLoad = LOAD
) -> list[PageMismatch]:
    fill_producer_pages(producer, load.producer_block_ids, num_tokens=load.num_tokens, salt=load.salt)
    p0, c0 = producer.snapshot(), consumer.snapshot()
    copy_pages(producer, consumer, pairs)
    return check_pools(producer=producer, consumer=consumer, producer_before=p0, consumer_before=c0, loads=[load])


def test_shared_pool_is_attachable_and_unlinked() -> None:
    pool = allocate_pool(make_config())
    name = pool.shm_names[0]
    assert name is not None
    other = shared_memory.SharedMemory(name=name)
    assert other.buf is not None
    pool.regions[0].buffer[:3] = b"abc"
    assert bytes(other.buf[:3]) == b"abc"
    other.close()
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(FileNotFoundError, match=r"No such file or directory"):
        shared_memory.SharedMemory(name=name)


def test_positions_are_tail_aligned() -> None:
    config = make_config()
    assert logical_positions(config, P_IDS, num_tokens=10) == [[0, 1, 2], [1, 2]]
    assert logical_positions(config, C_IDS, num_tokens=10) == [[1, 2], [1, 2]]
    assert logical_positions(config, BlockIds([]), num_tokens=10) == []


def test_positions_follow_declared_ends() -> None:
    # Protocol 1.1: a list that says it ends a block later sits a block later (ALIGN-1).
    config = make_config()
    assert logical_positions(config, P_IDS, num_tokens=10, block_ends=(4, 3)) == [[1, 2, 3], [1, 2]]
    with pytest.raises(ConfigError, match="expected 2 block ends, got 1"):
        logical_positions(config, P_IDS, num_tokens=10, block_ends=(3,))


def test_expected_pairs_pair_by_position_when_a_list_ends_later() -> None:
    # P's list ends one block past the request (a lookahead block): by position, C's blocks 1..2 take P's
    # blocks at positions 1..2, which are P's first two ids, not its last two as tail alignment would pair.
    config = make_config()
    shifted = ExpectedLoad(
        producer_block_ids=[[1, 2, 3], [4, 5]],
        consumer_block_ids=[[7, 8], [9, 10]],
        num_tokens=10,
        producer_block_ends=(4, 4),
    )
    pairs = [(c.group, c.position, c.producer_block, c.consumer_block) for c in expected_pairs(config, shifted)]
    assert pairs == [(0, 1, 1, 7), (0, 2, 2, 8), (1, 2, 4, 10)]
    # Ends that agree with the request's last block change nothing.
    same = attrs.evolve(LOAD, producer_block_ends=(3, 3), consumer_block_ends=(3, 3))
    assert expected_pairs(config, same) == expected_pairs(config, LOAD)


def test_expected_copies_tail_align_and_drop_nulls() -> None:
    config = make_config()
    load = ExpectedLoad(producer_block_ids=[[1, 2, 3], [0, 5]], consumer_block_ids=[[7, 8], [9, 10]], num_tokens=10)
    pairs = [(c.group, c.position, c.producer_block, c.consumer_block) for c in expected_pairs(config, load)]
    assert pairs == [(0, 1, 2, 7), (0, 2, 3, 8), (1, 2, 5, 10)]
    full_hit = ExpectedLoad(producer_block_ids=P_IDS, consumer_block_ids=[], num_tokens=10)
    assert expected_pairs(config, full_hit) == []


def test_keys_differ_by_every_part() -> None:
    config = make_config()
    base = expected_page(config, group=0, layer_index=0, position=1, salt=0)
    assert len(base) == PAGE_FA
    for other in [
        expected_page(config, group=1, layer_index=0, position=1, salt=0),
        expected_page(config, group=0, layer_index=1, position=1, salt=0),
        expected_page(config, group=0, layer_index=0, position=2, salt=0),
        expected_page(config, group=0, layer_index=0, position=1, salt=1),
    ]:
        assert other != base


def test_correct_transfer_passes(pools: tuple[PagePool, PagePool]) -> None:
    assert run(*pools, GOOD) == []


def test_front_trim_is_caught(pools: tuple[PagePool, PagePool]) -> None:
    # Front trim pairs C's blocks with P's first blocks (the B5 bug).
    found = run(*pools, [(0, 1, 7), (0, 2, 8), (1, 4, 9), (1, 5, 10)])
    assert {m.kind for m in found} == {MismatchKind.WRONG_CONTENT}
    assert {(m.group, m.block) for m in found} == {(0, 7), (0, 8)}
    assert "position 0" in found[0].what


def test_missing_page_is_caught(pools: tuple[PagePool, PagePool]) -> None:
    found = run(*pools, GOOD[:-1])
    assert [(m.kind, m.group, m.layer, m.block) for m in found] == [(MismatchKind.NOT_WRITTEN, 1, "sw0", 10)]


def test_wrong_group_and_stray_writes_are_caught(pools: tuple[PagePool, PagePool]) -> None:
    producer, consumer = pools
    found = run(producer, consumer, GOOD)
    assert found == []
    c0 = consumer.snapshot()
    p0 = producer.snapshot()
    consumer.page("sw0", 7)[:] = producer.page("sw0", 5)  # sw page into a block that only group 0 uses
    consumer.page("fa0", 0)[:1] = b"x"  # the null block
    consumer.regions[1].buffer[-1:] = b"y"  # padding after the last page
    found = check_pools(producer=producer, consumer=consumer, producer_before=p0, consumer_before=c0, loads=[])
    kinds = {(m.kind, m.block) for m in found}
    assert (MismatchKind.STRAY_WRITE, 7) in kinds
    assert (MismatchKind.STRAY_WRITE, 0) in kinds
    assert any(m.kind is MismatchKind.OUTSIDE_PAGES for m in found)


def test_failed_request_pages_are_undefined_but_producer_is_checked(pools: tuple[PagePool, PagePool]) -> None:
    producer, consumer = pools
    failed = ExpectedLoad(producer_block_ids=P_IDS, consumer_block_ids=C_IDS, num_tokens=10, salt="r1", loaded=False)
    assert run(producer, consumer, GOOD[:1], failed) == []
    p0, c0 = producer.snapshot(), consumer.snapshot()
    producer.page("fa1", 3)[:1] = b"z"
    found = check_pools(producer=producer, consumer=consumer, producer_before=p0, consumer_before=c0, loads=[failed])
    assert [(m.side, m.kind, m.block) for m in found] == [("producer", MismatchKind.PRODUCER_MODIFIED, 3)]


def test_other_request_salt_is_caught(pools: tuple[PagePool, PagePool]) -> None:
    producer, consumer = pools
    fill_producer_pages(producer, BlockIds([[6], [11]]), num_tokens=10, salt="r2")
    found = run(producer, consumer, [(0, 6, 7), *GOOD[1:]])
    assert {(m.kind, m.block) for m in found} == {(MismatchKind.WRONG_CONTENT, 7)}
    assert "salt 'r2'" in found[0].what or "producer's block 6" in found[0].what


# --------------------------------------------------------------------------- properties of the oracle


def _plan_request(config: KVCacheConfig, data: st.DataObject) -> ExpectedLoad:
    from math import lcm

    unit = lcm(*(g.kv_cache_spec.block_size for g in config.kv_cache_groups))
    tokens = data.draw(st.integers(1, 24), label="num_tokens")
    hit = unit * data.draw(st.integers(0, tokens // unit), label="hit_units")
    fresh = iter(range(1, config.num_blocks))
    producer, consumer = [], []
    for group in config.kv_cache_groups:
        total = -(-tokens // group.kv_cache_spec.block_size)
        producer.append([next(fresh) for _ in range(total)])
        consumer.append([next(fresh) for _ in range(total - hit // group.kv_cache_spec.block_size)])
    return ExpectedLoad(producer_block_ids=producer, consumer_block_ids=consumer, num_tokens=tokens, salt="p")


@given(config=configs(max_groups=3, num_blocks=160), data=st.data())
def test_oracle_accepts_a_correct_copy_and_catches_any_flipped_byte(config: KVCacheConfig, data: st.DataObject) -> None:
    load = _plan_request(config, data)
    with allocate_pool(config, shared=False) as producer, allocate_pool(config, shared=False) as consumer:
        fill_background(producer, seed="p")
        fill_background(consumer, seed="c")
        fill_producer_pages(producer, load.producer_block_ids, num_tokens=load.num_tokens, salt=load.salt)
        p0, c0 = producer.snapshot(), consumer.snapshot()
        # An independent copy of what the transfer must do: every layer's page of every tail-aligned pair.
        for copy in expected_pairs(config, load):
            for layer in config.kv_cache_groups[copy.group].layer_names:
                consumer.page(layer, copy.consumer_block)[:] = producer.page(layer, copy.producer_block)
        assert (
            check_pools(producer=producer, consumer=consumer, producer_before=p0, consumer_before=c0, loads=[load])
            == []
        )
        side = data.draw(st.sampled_from([producer, consumer]), label="side")
        region = data.draw(st.integers(0, len(side.regions) - 1), label="region")
        offset = data.draw(st.integers(0, side.regions[region].nbytes - 1), label="offset")
        side.regions[region].buffer[offset] ^= 0xFF
        found = check_pools(producer=producer, consumer=consumer, producer_before=p0, consumer_before=c0, loads=[load])
        assert found, f"flipping byte {offset} of region {region} went unnoticed"
        assert {m.side for m in found} == {"producer" if side is producer else "consumer"}


# --------------------------------------------------------------------------- state groups (PLAN-1)


def fa_state_config(num_blocks: int = 8) -> KVCacheConfig:
    """FA (B=6, page 96 B) + a state group of two layers: conv 24 B + SSM 48 B, padded to 96 B."""
    fa = FullAttentionSpec(block_size=6, num_kv_heads=1, head_size=4, dtype="float16")
    state = MambaSpec(block_size=6, shapes=[(4, 3), (2, 2, 3)], dtypes=["float16", "float32"], page_size_padded=96)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=96 * num_blocks, layers=["fa0"], layer_stride=0, block_stride=96),
            KVCacheTensor(size=192 * num_blocks, layers=["m0", "m1"], layer_stride=96, block_stride=192),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["fa0"], kv_cache_spec=fa),
            KVCacheGroupSpec(layer_names=["m0", "m1"], kv_cache_spec=state),
        ],
    )


@pytest.mark.parametrize(
    ("state_bytes", "expect"),
    [
        (72, None),  # conv + SSM: right
        (96, "padding bytes after the state tensors changed"),  # the padding travelled too
        (24, "found unrecognised bytes"),  # the SSM tensor was missed
    ],
)
def test_the_oracle_checks_state_tensor_bytes_and_the_padding(state_bytes: int, expect: str | None) -> None:
    config = fa_state_config()
    load = ExpectedLoad(producer_block_ids=[[1, 2], [3]], consumer_block_ids=[[4, 5], [6]], num_tokens=12, salt="s")
    with allocate_pool(config, shared=False) as producer, allocate_pool(config, shared=False) as consumer:
        fill_background(producer, seed="p")
        fill_background(consumer, seed="c")
        fill_producer_pages(producer, load.producer_block_ids, num_tokens=12, salt="s")
        p0, c0 = producer.snapshot(), consumer.snapshot()
        for p_id, c_id in ((1, 4), (2, 5)):
            consumer.page("fa0", c_id)[:] = producer.page("fa0", p_id)
        for layer in ("m0", "m1"):
            consumer.page(layer, 6)[:state_bytes] = producer.page(layer, 3)[:state_bytes]
        found = check_pools(producer=producer, consumer=consumer, producer_before=p0, consumer_before=c0, loads=[load])
    if expect is None:
        assert found == []
    else:
        assert {(m.kind, m.group, m.block) for m in found} == {(MismatchKind.WRONG_CONTENT, 1, 6)}
        assert len(found) == 2
        assert expect in found[0].what
