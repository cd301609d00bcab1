"""Property tests, vLLM's pinned values, past bugs and mutants for the offload rules (OFF-1 ... OFF-9).

Every reference function is compared with a naive token-by-token model: which
token positions each chunk holds, which a hit needs, which a load restores.
The pins are vLLM's two HMA scheduler tests, its lookup unit values and the
bug examples that docs/spec/offload.md cites with each rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import kvspec.reference._offload as off
import kvspec.spec as plain
from kvspec import (
    ChunkedLocalAttentionSpec,
    ConfigError,
    CrossAttentionSpec,
    FullAttentionSpec,
    GroupCountError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    LoadSet,
    MambaSpec,
    MLAAttentionSpec,
    OffloadConfig,
    OffloadKey,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    StatePositionError,
    StoreSet,
    UnsupportedHybridError,
    WindowCoverageError,
    check_offload_support,
    get_chunk_sizes,
    get_load_set,
    get_offload_keys,
    get_retained_chunk_starts,
    get_store_set,
    get_sub_block_offset,
    map_sub_blocks,
)
from kvspec.fast import get_offload_hit_tokens  # the fast twin, tested against plain (kvspec.spec)
from kvspec.presets import get_preset
from kvspec.spec.pins import Raises, pins_for
from kvspec.tools._vector_cases import _pin_inputs as pin_inputs

# --------------------------------------------------------------------------- helpers


def fa(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")


def sw(window: int, block_size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window)


def make_config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(layer_names=[f"layer.{g}"], kv_cache_spec=s) for g, s in enumerate(specs)]
    tensors = [
        KVCacheTensor(size=4 * s.page_size_bytes, layers=[f"layer.{g}"], layer_stride=0, block_stride=s.page_size_bytes)
        for g, s in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=tensors, kv_cache_groups=groups)


def offload(f: int = 1, h: int = 4) -> OffloadConfig:
    return OffloadConfig(blocks_per_chunk=f, hash_block_size=h)


def hashes(count: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(2, "big") for i in range(count))


def window_of(config: KVCacheConfig, g: int) -> int | None:
    spec = config.kv_cache_groups[g].kv_cache_spec
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def chunk_sizes(config: KVCacheConfig, f: int) -> list[int]:
    return [group.kv_cache_spec.block_size * f for group in config.kv_cache_groups]


def loaded_positions(load: LoadSet) -> tuple[tuple[int, int], ...]:
    """(group, GPU block position) of every destination, as vLLM's tests list them."""
    return tuple(
        (g, first + i)
        for g, (first, count) in enumerate(zip(load.first_block_indices, load.num_blocks, strict=True))
        for i in range(count)
    )


def stored_positions(store: StoreSet) -> tuple[tuple[int, int], ...]:
    """(group, GPU block position) of every source block of a store."""
    return tuple(
        (g, first + i)
        for g, (first, count) in enumerate(zip(store.first_block_indices, store.num_blocks, strict=True))
        for i in range(count)
    )


# --------------------------------------------------------------------------- the naive token-by-token model


def naive_needed_tokens(window: int | None, *, end: int, local: int) -> range:
    """Token positions whose KV the next token (at ``end``) reads and the GPU lacks: WIN-1's ranges."""
    return range(local if window is None else max(local, end - window + 1), end)


def naive_keys(config: KVCacheConfig, block_hashes: Sequence[bytes], h: int, f: int) -> list[list[OffloadKey]]:
    """Chunk k is complete once its last token (k+1)*C - 1 is hashed; its key is that token's hash."""
    covered = len(block_hashes) * h  # tokens the hashes cover
    keys: list[list[OffloadKey]] = []
    for g, size in enumerate(chunk_sizes(config, f)):
        complete = [k for k in range(covered) if (k + 1) * size <= covered]
        keys.append([OffloadKey(block_hash=block_hashes[((k + 1) * size - 1) // h], group=g) for k in complete])
    return keys


def naive_store(
    config: KVCacheConfig, ids: Sequence[Sequence[int]], *, tokens: int, next_chunk: Sequence[int], f: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Per group, the offered chunks and source ids, walking token by token."""
    chunks: list[list[int]] = []
    sources: list[list[int]] = []
    for g, group in enumerate(config.kv_cache_groups):
        block, size = group.kv_cache_spec.block_size, group.kv_cache_spec.block_size * f
        offered: list[int] = []
        source: list[int] = []
        for t in range(next_chunk[g] * size, (tokens // size) * size):
            k, position = t // size, t // block
            if ids[g][k * f + f - 1] == 0:  # the chunk's last block decides
                continue
            if not offered or offered[-1] != k:
                offered.append(k)
            if ids[g][position] != 0 and (not source or source[-1] != ids[g][position]):
                source.append(ids[g][position])
        chunks.append(offered)
        sources.append(source)
    return chunks, sources


def naive_load_positions(config: KVCacheConfig, *, tokens: int, local: int) -> list[list[int]]:
    """Per group, the GPU block positions a load restores: those holding a needed token."""
    out = []
    for g, group in enumerate(config.kv_cache_groups):
        block = group.kv_cache_spec.block_size
        needed = naive_needed_tokens(window_of(config, g), end=tokens, local=local)
        positions = sorted({t // block for t in needed})
        out.append(positions)
    return out


# --------------------------------------------------------------------------- strategies


def state(block_size: int) -> MambaSpec:
    """An align-mode Mamba-2 state group: chunk k holds the state after (k + 1) * C_g tokens (OFF-9)."""
    return MambaSpec(block_size=block_size, shapes=[(2, 3)], dtypes=["float16"], cache_mode="align")


@st.composite
def offload_configs(draw: st.DrawFn, *, states: bool = False) -> tuple[KVCacheConfig, OffloadConfig]:
    """1-3 groups of full attention or sliding window; one block size with f in 1..4, or mixed sizes with f = 1.

    With ``states``, f = 1 and each group may be an align-mode state group (OFF-9).
    """
    h = draw(st.sampled_from([1, 2, 4]))
    count = draw(st.integers(1, 3))
    if draw(st.booleans()) and not states:
        f = draw(st.integers(1, 4))
        sizes = [h * draw(st.integers(1, 3))] * count
    else:
        f = 1
        sizes = [h * draw(st.integers(1, 4)) for _ in range(count)]
    specs: list[KVCacheSpec] = []
    for size in sizes:
        if states and draw(st.booleans()):
            specs.append(state(size))
            continue
        window = draw(st.one_of(st.none(), st.integers(1, 40)))
        specs.append(fa(size) if window is None else sw(window, size))
    return make_config(*specs), offload(f, h)


def _lcm(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


@st.composite
def hit_cases(
    draw: st.DrawFn, *, states: bool = False
) -> tuple[KVCacheConfig, OffloadConfig, list[list[bool]], int, int]:
    config, off_config = draw(offload_configs(states=states))
    blocks = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    step = _lcm(blocks)
    num_tokens = draw(st.integers(1, 120))
    local = step * draw(st.integers(0, num_tokens // step))
    sizes = chunk_sizes(config, off_config.blocks_per_chunk)
    present = [
        draw(st.lists(st.booleans(), min_size=num_tokens // s, max_size=num_tokens // s).map(list)) for s in sizes
    ]
    if draw(st.booleans()):  # mostly present, so that long hits are common
        present = [[True] * len(p) for p in present]
        for p in present:
            for k in draw(st.lists(st.integers(0, max(0, len(p) - 1)), max_size=2)):
                if p:
                    p[k] = False
    return config, off_config, present, num_tokens, local


# --------------------------------------------------------------------------- OFF-1 geometry


@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=4), f=st.integers(1, 5), h=st.integers(1, 16))
def test_chunk_sizes_property(sizes: list[int], f: int, h: int) -> None:
    config = make_config(*(fa(size) for size in sizes))
    if f > 1 and len(set(sizes)) > 1:
        with pytest.raises(ConfigError, match="expected 1 when groups differ in block size"):
            get_chunk_sizes(config, blocks_per_chunk=f, hash_block_size=h)
    elif any(size % h for size in sizes):
        with pytest.raises(ConfigError, match="which does not divide group"):
            get_chunk_sizes(config, blocks_per_chunk=f, hash_block_size=h)
    else:
        chunks = get_chunk_sizes(config, blocks_per_chunk=f, hash_block_size=h)
        # A chunk holds f whole blocks and ends on a hash boundary.
        assert chunks == tuple(size * f for size in sizes)
        assert all(c % h == 0 for c in chunks)


def test_chunk_sizes_multiply_block_sizes_by_f() -> None:
    config = make_config(fa(4), sw(8, 4))
    assert get_chunk_sizes(config, blocks_per_chunk=3) == (12, 12)
    assert get_chunk_sizes(make_config(fa(12), fa(16)), blocks_per_chunk=1, hash_block_size=4) == (12, 16)


def test_f_above_one_needs_one_block_size() -> None:
    with pytest.raises(ConfigError, match=r"expected 1 when groups differ in block size \(group 0 has 12, group 1"):
        get_chunk_sizes(make_config(fa(12), fa(16)), blocks_per_chunk=2)


def test_hash_block_size_divides_every_block_size() -> None:
    with pytest.raises(ConfigError, match="does not divide group 1's block size 12"):
        get_chunk_sizes(make_config(fa(16), fa(12)), blocks_per_chunk=1, hash_block_size=8)


def test_offload_config_rejects_non_positive_fields() -> None:
    with pytest.raises(ConfigError, match=r"OffloadConfig.blocks_per_chunk: expected a positive int, got 0"):
        OffloadConfig(blocks_per_chunk=0, hash_block_size=16)


# --------------------------------------------------------------------------- OFF-2 keys


@given(cfg=offload_configs(), count=st.integers(0, 60))
def test_keys_match_the_token_model(cfg: tuple[KVCacheConfig, OffloadConfig], count: int) -> None:
    config, off_config = cfg
    block_hashes = hashes(count)
    keys = get_offload_keys(config, block_hashes, offload=off_config)
    expected = naive_keys(config, block_hashes, off_config.hash_block_size, off_config.blocks_per_chunk)
    assert [list(k) for k in keys] == expected


def test_keys_of_two_block_sizes_pin() -> None:
    # Research note R1: h = 4, b = (12, 16), f = 1: 25 tokens give hash indices (2, 5) and (3,).
    config = make_config(fa(12), fa(16))
    keys = get_offload_keys(config, hashes(6), offload=offload())
    assert [[k.block_hash for k in group] for group in keys] == [[hashes(6)[2], hashes(6)[5]], [hashes(6)[3]]]
    # At 48 tokens group 0's key 3 and group 1's key 2 share hash index 11 but are different keys.
    at_48 = get_offload_keys(config, hashes(12), offload=offload())
    assert at_48[0][3].block_hash == at_48[1][2].block_hash
    assert at_48[0][3] != at_48[1][2]
    assert at_48[1][2].to_bytes() == hashes(12)[11] + b"\x00\x00\x00\x01"


# --------------------------------------------------------------------------- OFF-3 store


@st.composite
def store_cases(draw: st.DrawFn) -> tuple[KVCacheConfig, OffloadConfig, list[list[int]], int, list[int]]:
    config, off_config = draw(offload_configs())
    tokens = draw(st.integers(0, 80))
    ids = []
    for group in config.kv_cache_groups:
        count = -(-tokens // group.kv_cache_spec.block_size)
        nulls = draw(st.integers(0, count))
        ids.append([0] * nulls + list(range(100, 100 + count - nulls)))
    nexts = [draw(st.integers(0, tokens // s + 1)) for s in chunk_sizes(config, off_config.blocks_per_chunk)]
    return config, off_config, ids, tokens, nexts


@given(case=store_cases())
@example(  # #42945: a chunk straddling the window edge, f = 3
    case=(make_config(fa(4), sw(8, 4)), offload(3), [list(range(1, 11)), [0] * 5 + list(range(105, 110))], 40, [0, 0])
)
def test_store_set_matches_the_token_model(
    case: tuple[KVCacheConfig, OffloadConfig, list[list[int]], int, list[int]],
) -> None:
    config, off_config, ids, tokens, nexts = case
    store = get_store_set(config, ids, num_offloadable_tokens=tokens, next_chunk=nexts, offload=off_config)
    chunks, sources = naive_store(config, ids, tokens=tokens, next_chunk=nexts, f=off_config.blocks_per_chunk)
    assert [list(c) for c in store.chunks] == chunks
    assert [list(s) for s in store.block_ids] == sources
    assert list(store.num_blocks) == [len(s) for s in sources]
    for g, (first, count) in enumerate(zip(store.first_block_indices, store.num_blocks, strict=True)):
        # The first source's position, and the sources are consecutive positions from it.
        assert [ids[g][p] for p in range(first, first + count)] == sources[g]
        # Each source block lands in the sub-block its position names (OFF-7).
        for entry, (i, s) in enumerate(map_sub_blocks(first, count, blocks_per_chunk=off_config.blocks_per_chunk)):
            assert store.chunks[g][i] * off_config.blocks_per_chunk + s == first + entry
    sizes = chunk_sizes(config, off_config.blocks_per_chunk)
    assert list(store.next_chunks) == [max(n, tokens // s) for n, s in zip(nexts, sizes, strict=True)]


@given(case=store_cases(), cuts=st.lists(st.integers(0, 80), max_size=5))
def test_stores_in_steps_offer_each_chunk_once(
    case: tuple[KVCacheConfig, OffloadConfig, list[list[int]], int, list[int]], cuts: list[int]
) -> None:
    """Running a request step by step offers what one store at the end offers, each chunk once (OFF-3)."""
    config, off_config, ids, tokens, _ = case
    start = [0] * config.num_groups
    whole = get_store_set(config, ids, num_offloadable_tokens=tokens, next_chunk=start, offload=off_config)
    nexts: Sequence[int] = start
    chunks: list[list[int]] = [[] for _ in range(config.num_groups)]
    sources: list[list[int]] = [[] for _ in range(config.num_groups)]
    for step in [*sorted(c for c in cuts if c <= tokens), tokens]:
        store = get_store_set(config, ids, num_offloadable_tokens=step, next_chunk=nexts, offload=off_config)
        for g in range(config.num_groups):
            chunks[g] += store.chunks[g]
            sources[g] += store.block_ids[g]
        nexts = store.next_chunks
    assert [tuple(c) for c in chunks] == list(whole.chunks)
    assert [tuple(s) for s in sources] == list(whole.block_ids)
    assert tuple(nexts) == whole.next_chunks


def test_store_straddling_chunk_42945() -> None:
    # Research note R2: f = 3, b = 4, window allocation [0,0,0,0,0,105..109] at O = 40.
    config = make_config(fa(4), sw(8, 4))
    ids = [list(range(1, 11)), [0, 0, 0, 0, 0, 105, 106, 107, 108, 109]]
    store = get_store_set(config, ids, num_offloadable_tokens=40, next_chunk=[0, 0], offload=offload(3))
    assert store.chunks[1] == (1, 2)
    assert store.block_ids[1] == (105, 106, 107, 108)
    assert store.first_block_indices[1] == 5
    assert store.num_blocks[1] == 4  # #42945 counted f per chunk: 6
    assert store.partial_chunks == ((), (1,))
    assert store.complete_chunks == ((0, 1, 2), (2,))


def test_store_and_load_models_check_themselves() -> None:
    with pytest.raises(
        ConfigError, match=r"LoadSet.chunk_ranges\[0\]: expected \(first, stop\) with 0 <= first <= stop"
    ):
        LoadSet(blocks_per_chunk=1, chunk_ranges=[(2, 1)], block_ids=[[]], first_block_indices=[0], num_blocks=[0])
    with pytest.raises(ConfigError, match=r"LoadSet.block_ids\[0\]: expected no null block id 0"):
        LoadSet(blocks_per_chunk=1, chunk_ranges=[(0, 1)], block_ids=[[0]], first_block_indices=[0], num_blocks=[1])
    with pytest.raises(ConfigError, match="StoreSet: expected one entry per group in every field"):
        StoreSet(
            blocks_per_chunk=1,
            chunk_ranges=[(0, 1)],
            block_ids=[[1]],
            first_block_indices=[0],
            num_blocks=[1],
            next_chunks=[1, 1],
        )


def test_store_model_refuses_a_count_with_nulls() -> None:
    with pytest.raises(ConfigError, match=r"StoreSet.num_blocks\[1\]: expected 4 .*got 6"):
        StoreSet(
            blocks_per_chunk=3,
            chunk_ranges=[(0, 1), (1, 3)],
            block_ids=[[1, 2, 3], [105, 106, 107, 108]],
            first_block_indices=[0, 5],
            num_blocks=[3, 6],
            next_chunks=[1, 3],
        )


def test_store_rejects_nulls_after_a_real_block() -> None:
    with pytest.raises(
        ConfigError, match=r"block_ids\[0\]: expected null ids \(0\) only as a prefix, got 0 at index 2"
    ):
        get_store_set(make_config(fa(4)), [[5, 6, 0, 7]], num_offloadable_tokens=16, next_chunk=[0], offload=offload())


def test_store_needs_one_next_chunk_per_group() -> None:
    with pytest.raises(GroupCountError, match="next_chunk: expected 2 groups"):
        get_store_set(
            make_config(fa(4), fa(4)), [[1], [2]], num_offloadable_tokens=4, next_chunk=[0], offload=offload()
        )


# --------------------------------------------------------------------------- vLLM: two groups, full + sliding window


FA_SW = make_config(fa(4), sw(8, 4))
T = TypeVar("T", bound=Callable[..., None])


def test_vllm_full_and_sliding_window_stores() -> None:
    """Prompt of 12 then 15 decoded tokens: chunks 0-5 of both groups stored, 12 GPU blocks."""
    ids = [list(range(1, 8)), list(range(11, 18))]
    first = get_store_set(FA_SW, ids, num_offloadable_tokens=12, next_chunk=[0, 0], offload=offload())
    assert first.chunks == ((0, 1, 2), (0, 1, 2))
    second = get_store_set(FA_SW, ids, num_offloadable_tokens=27, next_chunk=first.next_chunks, offload=offload())
    assert second.chunks == ((3, 4, 5), (3, 4, 5))
    positions = stored_positions(first) + stored_positions(second)
    expected_stored = (0, 1, 2, 3, 4, 5)
    assert (
        sorted(p for g, p in positions if g == 0) == sorted(p for g, p in positions if g == 1) == list(expected_stored)
    )
    assert len(positions) == 12
    # Touch on the first lookup (no hit): 3 keys in each group (OFF-8).
    keys = get_offload_keys(FA_SW, hashes(3), offload=offload())
    starts = get_retained_chunk_starts(FA_SW, num_computed_tokens=0, offload=offload())
    assert [len(k[s:]) for k, s in zip(keys, starts, strict=True)] == [3, 3]


def test_vllm_full_and_sliding_window_13_token_hit() -> None:
    present = [[True] * 3, [True] * 3]
    hit = get_offload_hit_tokens(FA_SW, present, num_tokens=13, local_hit_tokens=0, offload=offload())
    assert hit == 12
    ids = [[1, 2, 3, 4], [0, 6, 7, 8]]  # the window manager nulls floor((12 - 8 + 1) / 4) = 1 block
    load = get_load_set(FA_SW, ids, num_tokens=12, local_hit_tokens=0, offload=offload())
    assert loaded_positions(load) == ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2))
    keys = get_offload_keys(FA_SW, hashes(3), offload=offload())
    starts = get_retained_chunk_starts(FA_SW, num_computed_tokens=12, offload=offload())
    assert [len(k[s:]) for k, s in zip(keys, starts, strict=True)] == [3, 2]


def test_vllm_full_and_sliding_window_17_tokens_after_a_12_token_gpu_hit() -> None:
    present = [[True] * 4, [True] * 4]
    hit = get_offload_hit_tokens(FA_SW, present, num_tokens=17, local_hit_tokens=12, offload=offload())
    assert hit == 4
    ids = [[1, 2, 3, 4, 5], [0, 6, 7, 8, 9]]
    load = get_load_set(FA_SW, ids, num_tokens=16, local_hit_tokens=12, offload=offload())
    assert loaded_positions(load) == ((0, 3), (1, 3))


# --------------------------------------------------------------------------- vLLM: two groups, different block sizes


TWO_SIZES = make_config(fa(12), fa(16))


def test_vllm_different_block_sizes_store_steps() -> None:
    ids = [list(range(1, 9)), list(range(11, 17))]
    steps = [
        (25, ((0, 1), (0,))),  # stored by token 31: ((0,0),(0,1),(1,0))
        (32, ((), (1,))),  # by 35: ((1,1),)
        (36, ((2,), ())),  # by 47: ((0,2),)
        (48, ((3,), (2,))),  # next step: ((0,3),(1,2))
        (96, ((4, 5, 6, 7), (3, 4, 5))),  # to 96 with EOS
    ]
    nexts: Sequence[int] = (0, 0)
    for tokens, expected in steps:
        store = get_store_set(TWO_SIZES, ids, num_offloadable_tokens=tokens, next_chunk=nexts, offload=offload())
        assert store.chunks == expected, tokens
        nexts = store.next_chunks


def test_vllm_different_block_sizes_touch_lengths() -> None:
    # Keys (all full attention, so all touched) at 25, 32, 36 and 48 tokens.
    lengths = [
        tuple(len(k) for k in get_offload_keys(TWO_SIZES, hashes(n // 4), offload=offload())) for n in (25, 32, 36, 48)
    ]
    assert lengths == [(2, 1), (2, 2), (3, 2), (4, 3)]
    assert get_retained_chunk_starts(TWO_SIZES, num_computed_tokens=48, offload=offload()) == (0, 0)


def test_vllm_different_block_sizes_loads() -> None:
    present = [[True] * 4, [True] * 3]
    assert get_offload_hit_tokens(TWO_SIZES, present, num_tokens=48, local_hit_tokens=0, offload=offload()) == 48
    ids = [list(range(1, 9)), list(range(11, 17))]
    load = get_load_set(TWO_SIZES, ids, num_tokens=48, local_hit_tokens=0, offload=offload())
    assert loaded_positions(load) == ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2))
    # 85 tokens, 48 on the GPU: M = min(85, 7 * 12, 5 * 16) = 80; chunk 6 (tokens 72-83) is loaded whole.
    present = [[True] * 7, [True] * 5]
    assert get_offload_hit_tokens(TWO_SIZES, present, num_tokens=85, local_hit_tokens=48, offload=offload()) == 32
    load = get_load_set(TWO_SIZES, ids, num_tokens=80, local_hit_tokens=48, offload=offload())
    assert loaded_positions(load) == ((0, 4), (0, 5), (0, 6), (1, 3), (1, 4))
    assert load.chunks == ((4, 5, 6), (3, 4))


# --------------------------------------------------------------------------- vLLM's sliding-window lookup unit values


@pytest.mark.parametrize(
    ("present", "window_chunks", "expected"),
    [
        ([False, True, True], 2, 3),  # keys [1,2,3], {2,3} present
        ([True, True, False, True, True], 2, 5),  # the rightmost window wins
        ([True, False, True, True, True], 4, 1),  # no complete window: the run from the start
        ([True, True, False], 3, 2),
    ],
)
def test_vllm_sliding_window_lookup_values(present: list[bool], window_chunks: int, expected: int) -> None:
    # One token per chunk: a window of Wc chunks before the end is W = Wc + 1 tokens (the end token is computed).
    found = off._window_hit_end(present, end=len(present), local=0, size=1, window=window_chunks + 1)
    assert found == expected


# --------------------------------------------------------------------------- OFF-5 hit


def off5_pin_examples(test: T) -> T:
    """An ``@example`` for every OFF-5 pin of kvspec/spec/pins.py with a hit (N = C_g multiples, gaps, off the grid)."""
    for pin in pins_for("OFF-5"):
        if not isinstance(pin.expected["get_offload_hit_tokens"], Raises):
            given_ = pin_inputs(pin)
            case = (
                given_["config"],
                given_["offload"],
                given_["present"],
                given_["num_tokens"],
                given_["local_hit_tokens"],
            )
            test = example(case=case).via(f"OFF-5 pin {pin.name}")(test)
    return test


@given(case=hit_cases())
@off5_pin_examples
@example(case=(make_config(fa(12), sw(16, 16)), offload(), [[True, True, True, False], [True, False, True]], 48, 0))
def test_hit_matches_the_token_model(case: tuple[KVCacheConfig, OffloadConfig, list[list[bool]], int, int]) -> None:
    config, off_config, present, num_tokens, local = case
    hit = get_offload_hit_tokens(config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config)
    expected = plain.get_offload_hit_tokens(
        config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config
    )
    assert hit == expected


def test_hit_window_chunks_missing_in_the_middle() -> None:
    # Research note R3: window chunks {0, 1, 2, 4} of 6 present with N = 25: the last complete window ends at 12.
    present = [[True] * 6, [True, True, True, False, True, False]]
    assert get_offload_hit_tokens(FA_SW, present, num_tokens=25, local_hit_tokens=0, offload=offload()) == 12


def test_hit_is_capped_at_n_minus_one_with_a_window_group() -> None:
    present = [[True] * 3, [True] * 3]
    assert get_offload_hit_tokens(FA_SW, present, num_tokens=12, local_hit_tokens=0, offload=offload()) == 11
    fa_only = make_config(fa(4))
    assert get_offload_hit_tokens(fa_only, [[True] * 3], num_tokens=12, local_hit_tokens=0, offload=offload()) == 12


def test_hit_is_zero_below_one_chunk() -> None:
    present = [[False, True, True], [True] * 3]
    assert get_offload_hit_tokens(FA_SW, present, num_tokens=13, local_hit_tokens=0, offload=offload()) == 0
    # Local hit 8 of 13 tokens with f = 3 (C = 12): at most 4 more tokens, less than one chunk.
    present = [[True], [True]]
    assert get_offload_hit_tokens(FA_SW, present, num_tokens=13, local_hit_tokens=8, offload=offload(3)) == 0


def test_hit_window_left_off_its_chunk_grid_needs_the_chunk_before() -> None:
    """Mixed chunk sizes: full attention (C = 12) stops the hit at M = 36, off the window's 16-token grid.

    The window (W = 16) then needs tokens [21, 35]: chunks 1 and 2, not only the ``cdiv(W, C) = 1``
    chunk before M that vLLM asks for. With chunk 1 absent the hit falls back to 16.
    """
    config = make_config(fa(12), sw(16, 16))
    full = [True, True, True, False]
    assert (
        get_offload_hit_tokens(
            config, [full, [True, False, True]], num_tokens=48, local_hit_tokens=0, offload=offload()
        )
        == 16
    )
    assert (
        get_offload_hit_tokens(
            config, [full, [False, True, True]], num_tokens=48, local_hit_tokens=0, offload=offload()
        )
        == 36
    )


def test_hit_keys_beyond_the_request_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"present\[0\]: expected at most 3 keys"):
        get_offload_hit_tokens(FA_SW, [[True] * 4, [True] * 3], num_tokens=13, local_hit_tokens=0, offload=offload())


def test_hit_local_hit_on_a_block_boundary() -> None:
    with pytest.raises(ConfigError, match="local_hit_tokens: expected a multiple of group 0's block size 4, got 5"):
        get_offload_hit_tokens(FA_SW, [[True] * 3, [True] * 3], num_tokens=13, local_hit_tokens=5, offload=offload())


# --------------------------------------------------------------------------- OFF-6 load


def allocation(config: KVCacheConfig, *, tokens: int, start: int = 1) -> list[list[int]]:
    """A GPU allocation as vLLM's managers give it: window groups null floor((T - W + 1) / B) leading blocks."""
    ids = []
    for g, group in enumerate(config.kv_cache_groups):
        block, window = group.kv_cache_spec.block_size, window_of(config, g)
        count = -(-tokens // block)
        nulls = 0 if window is None else max(0, tokens - window + 1) // block
        ids.append([0] * nulls + list(range(start + 1000 * g + nulls, start + 1000 * g + count)))
    return ids


@given(case=hit_cases())
@example(case=(make_config(fa(32), sw(4096, 32)), offload(8, 32), [[True] * 382, [True] * 382], 98013, 0))
def test_load_restores_exactly_the_needed_blocks_from_present_chunks(
    case: tuple[KVCacheConfig, OffloadConfig, list[list[bool]], int, int],
) -> None:
    config, off_config, present, num_tokens, local = case
    f = off_config.blocks_per_chunk
    hit = get_offload_hit_tokens(config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config)
    assume(hit > 0)
    tokens = local + hit
    ids = allocation(config, tokens=tokens)
    load = get_load_set(config, ids, num_tokens=tokens, local_hit_tokens=local, offload=off_config)
    expected = naive_load_positions(config, tokens=tokens, local=local)
    for g in range(config.num_groups):
        positions = list(range(load.first_block_indices[g], load.first_block_indices[g] + load.num_blocks[g]))
        assert positions == expected[g]
        assert list(load.block_ids[g]) == [ids[g][p] for p in positions]
        # Every chunk read was verified present by the hit (OFF-5 soundness).
        assert all(present[g][k] for k in load.chunks[g]), (g, load.chunks[g])
        # Each destination reads the sub-block holding its own tokens (OFF-7).
        for position, (entry, sub) in zip(positions, load.sub_blocks[g], strict=True):
            assert load.chunks[g][entry] * f + sub == position
        window = window_of(config, g)
        if window is not None:
            block = config.kv_cache_groups[g].kv_cache_spec.block_size
            assert load.num_blocks[g] <= -(-(window + block - 1) // block)  # #48959's tight bound


def test_load_sliding_window_bound_48959() -> None:
    # W = 4096, B = 32, f = 8, T = 98012: the window spans 129 blocks; cdiv(W, C) * f = 128 was one too few.
    config = make_config(fa(32), sw(4096, 32))
    load = get_load_set(
        config, allocation(config, tokens=98012), num_tokens=98012, local_hit_tokens=0, offload=offload(8, 32)
    )
    assert load.num_blocks[1] == 129 == -(-(4096 + 32 - 1) // 32)
    assert load.first_block_indices[1] == (98012 - 4096 + 1) // 32 == 2934
    assert load.chunks[1] == tuple(range(2934 // 8, -(-98012 // 256)))


def test_load_refuses_a_null_destination() -> None:
    with pytest.raises(
        WindowCoverageError, match=r"block_ids\[1\]\[1\]: expected a real block to restore tokens \[4, 8\)"
    ):
        get_load_set(FA_SW, [[1, 2, 3], [0, 0, 7]], num_tokens=12, local_hit_tokens=0, offload=offload())


# --------------------------------------------------------------------------- OFF-7 sub-blocks


@given(first=st.integers(0, 50), count=st.integers(0, 30), f=st.integers(1, 6))
@example(first=4, count=5, f=3)
def test_sub_block_map_matches_positions(first: int, count: int, f: int) -> None:
    mapped = map_sub_blocks(first, count, blocks_per_chunk=f)
    assert mapped == tuple(((first + i) // f - first // f, (first + i) % f) for i in range(count))
    if count:
        entries = mapped[-1][0] + 1
        assert entries == -(-(count + first % f) // f)  # ceil((n + skip) / f) chunk entries


def test_sub_block_map_f3_from_block_4() -> None:
    # Research note section 3: chunks K1, K2 into GPU blocks 4-8: (K1,1), (K1,2), (K2,0), (K2,1), (K2,2).
    assert map_sub_blocks(4, 5, blocks_per_chunk=3) == ((0, 1), (0, 2), (1, 0), (1, 1), (1, 2))


@given(row=st.integers(0, 20), f=st.integers(1, 6), page=st.integers(1, 64))
def test_sub_blocks_tile_their_chunk_row(row: int, f: int, page: int) -> None:
    offsets = [get_sub_block_offset(row, s, page_size=page, blocks_per_chunk=f) for s in range(f)]
    assert offsets == list(range(row * f * page, (row + 1) * f * page, page))


def test_sub_block_index_inside_the_row() -> None:
    with pytest.raises(ConfigError, match=r"sub_block: expected an int in \[0, 3\), got 3"):
        get_sub_block_offset(0, 3, page_size=8, blocks_per_chunk=3)


# --------------------------------------------------------------------------- OFF-4 validity (store, then load)


def _written_sub_blocks(store: StoreSet) -> set[tuple[int, int, int]]:
    """(group, chunk, sub-block) every source block of a store writes."""
    written = set()
    for g, (first, count) in enumerate(zip(store.first_block_indices, store.num_blocks, strict=True)):
        for entry, sub in map_sub_blocks(first, count, blocks_per_chunk=store.blocks_per_chunk):
            written.add((g, store.chunks[g][entry], sub))
    return written


def _read_sub_blocks(load: LoadSet) -> set[tuple[int, int, int]]:
    return {(g, load.chunks[g][entry], sub) for g, group in enumerate(load.sub_blocks) for entry, sub in group}


def store_then_load(
    config: KVCacheConfig,
    off_config: OffloadConfig,
    *,
    first_tokens: int,
    first_local: int,
    second_tokens: int,
    count_partial: bool = False,
) -> tuple[set[tuple[int, int, int]], set[tuple[int, int, int]]]:
    """R1 stores everything it computed after a GPU prefix hit; R2 (same prefix) hits and loads."""
    ids = allocation(config, tokens=first_local)  # nulls of R1's GPU prefix hit ...
    for g, group in enumerate(config.kv_cache_groups):  # ... then fresh blocks for what R1 computes
        count = -(-first_tokens // group.kv_cache_spec.block_size)
        ids[g] += list(range(5000 + 1000 * g + len(ids[g]), 5000 + 1000 * g + count))
    store = get_store_set(
        config, ids, num_offloadable_tokens=first_tokens, next_chunk=[0] * config.num_groups, offload=off_config
    )
    stored = store.chunks if count_partial else store.complete_chunks
    sizes = chunk_sizes(config, off_config.blocks_per_chunk)
    present = [[k in stored[g] for k in range(second_tokens // sizes[g])] for g in range(config.num_groups)]
    hit = get_offload_hit_tokens(config, present, num_tokens=second_tokens, local_hit_tokens=0, offload=off_config)
    if hit == 0:
        return _written_sub_blocks(store), set()
    load = get_load_set(config, allocation(config, tokens=hit), num_tokens=hit, local_hit_tokens=0, offload=off_config)
    return _written_sub_blocks(store), _read_sub_blocks(load)


def test_partial_chunk_is_never_read_inferred_hazard() -> None:
    # Research note section 6: f = 3, b = 4, W = 8; R1 (40 tokens) had a 28-token GPU hit, window blocks 0-4 null.
    # R1 writes only sub-block 2 of window chunk 1; a 25-token request must not load chunk 1 from sub-block 1.
    written, read = store_then_load(FA_SW, offload(3), first_tokens=40, first_local=28, second_tokens=25)
    assert read <= written
    written, read = store_then_load(
        FA_SW, offload(3), first_tokens=40, first_local=28, second_tokens=25, count_partial=True
    )
    assert (1, 1, 1) in read - written  # counting partial chunks present reads tokens 16-19, never written


@given(
    cfg=offload_configs(),
    first_tokens=st.integers(1, 80),
    local_blocks=st.integers(0, 10),
    second_tokens=st.integers(1, 80),
)
def test_no_load_reads_an_unwritten_sub_block(
    cfg: tuple[KVCacheConfig, OffloadConfig], first_tokens: int, local_blocks: int, second_tokens: int
) -> None:
    config, off_config = cfg
    step = _lcm([g.kv_cache_spec.block_size for g in config.kv_cache_groups])
    first_local = min(local_blocks * step, (first_tokens // step) * step)
    written, read = store_then_load(
        config, off_config, first_tokens=first_tokens, first_local=first_local, second_tokens=second_tokens
    )
    assert read <= written


# --------------------------------------------------------------------------- OFF-8 retention


@given(cfg=offload_configs(), chunks=st.integers(1, 12))
def test_retained_chunks_suffice_and_are_needed(cfg: tuple[KVCacheConfig, OffloadConfig], chunks: int) -> None:
    config, off_config = cfg
    sizes = chunk_sizes(config, off_config.blocks_per_chunk)
    end = _lcm(sizes) * chunks
    has_window = any(window_of(config, g) is not None for g in range(config.num_groups))
    num_tokens = end + 1 if has_window else end
    starts = get_retained_chunk_starts(config, num_computed_tokens=end, offload=off_config)
    present = [[k >= s for k in range(num_tokens // size)] for s, size in zip(starts, sizes, strict=True)]
    assert get_offload_hit_tokens(config, present, num_tokens=num_tokens, local_hit_tokens=0, offload=off_config) == end
    for g, start in enumerate(starts):
        window = window_of(config, g)
        if start > 0 and window is not None and window >= 2:  # the first retained chunk holds a needed token
            short = [list(p) for p in present]
            short[g][start] = False
            assert (
                get_offload_hit_tokens(config, short, num_tokens=num_tokens, local_hit_tokens=0, offload=off_config)
                < end
            )


# --------------------------------------------------------------------------- OFF-9 admission


@pytest.mark.parametrize(
    "spec",
    [
        ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", attention_chunk_size=8),
        CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16"),
    ],
    ids=["chunked-local", "cross-attention"],
)
def test_other_groups_fail_closed(spec: KVCacheSpec) -> None:
    config = make_config(fa(4), spec)
    kind = spec.kind.value
    with pytest.raises(UnsupportedHybridError, match=rf"offload: group 1 \(kind {kind}, .*not admitted \(OFF-9\)"):
        check_offload_support(config)
    with pytest.raises(UnsupportedHybridError, match=rf"group 1 \(kind {kind}"):
        get_offload_hit_tokens(config, [[True], [True]], num_tokens=5, local_hit_tokens=0, offload=offload())
    with pytest.raises(UnsupportedHybridError, match=rf"group 1 \(kind {kind}"):
        get_load_set(config, [[1], [2]], num_tokens=4, local_hit_tokens=0, offload=offload())


def test_a_state_group_without_prefix_caching_or_with_several_blocks_per_chunk_fails_closed() -> None:
    """none mode keeps no state at a chunk end; f > 1 puts one state and f - 1 nulls in a chunk (OFF-9, 161, 162)."""
    none_mode = make_config(fa(4), MambaSpec(block_size=4, shapes=[(2, 3)], dtypes=["float16"]))
    for call in (
        lambda: check_offload_support(none_mode),
        lambda: get_offload_hit_tokens(
            none_mode, [[True], [True]], num_tokens=5, local_hit_tokens=0, offload=offload()
        ),
        lambda: get_load_set(none_mode, [[1], [2]], num_tokens=4, local_hit_tokens=0, offload=offload()),
        lambda: get_store_set(none_mode, [[1], [2]], num_offloadable_tokens=4, next_chunk=[0, 0], offload=offload()),
    ):
        with pytest.raises(UnsupportedHybridError, match=r"group 1 \(kind mamba, mamba2\) has cache_mode='none'"):
            call()
    aligned = make_config(fa(4), state(4))
    check_offload_support(aligned)
    with pytest.raises(UnsupportedHybridError, match=r"group 1 .*blocks_per_chunk=2; expected 1 \(OFF-9\)"):
        get_offload_hit_tokens(aligned, [[True], [True]], num_tokens=9, local_hit_tokens=0, offload=offload(2))
    with pytest.raises(UnsupportedHybridError, match=r"blocks_per_chunk=2"):
        plain.get_offload_hit_tokens(aligned, [[True], [True]], num_tokens=9, local_hit_tokens=0, offload=offload(2))


# The research note's R6 example and #51094's shape: B = 4 full attention and an align-mode state group, f = 1.
FA_STATE = make_config(fa(4), state(4))


@pytest.mark.parametrize(
    ("num_tokens", "local", "state_present", "hit"),
    [
        (16, 0, [1, 1, 1, 1], 12),  # M = N - 1 = 15 rounds down to 12: chunk 2, never chunk 3 (state after 16)
        (17, 0, [1, 1, 1, 1], 16),  # N - 1 = 16 is on the grid
        (16, 0, [1, 1, 0, 0], 8),  # the last present state chunk ends the hit
        (16, 0, [0, 1, 0, 1], 8),  # chunk 3 is past N - 1; chunk 2 absent; chunk 1 holds the state after 8
        (16, 4, [1, 0, 0, 1], 0),  # from C = 4, no present state ends at 8 or 12
        (16, 8, [0, 0, 1, 0], 4),  # earlier states are not read: only the chunk ending the hit
    ],
)
def test_a_state_hit_ends_on_a_present_state_chunk(
    num_tokens: int, local: int, state_present: list[int], hit: int
) -> None:
    """OFF-5: the state group supports an end only on its chunk grid, with that chunk present (vLLM #44599)."""
    present = [[True] * (num_tokens // 4), [bool(p) for p in state_present][: num_tokens // 4]]
    assert (
        get_offload_hit_tokens(FA_STATE, present, num_tokens=num_tokens, local_hit_tokens=local, offload=offload())
        == hit
    )
    definition = plain.get_offload_hit_tokens(
        FA_STATE, present, num_tokens=num_tokens, local_hit_tokens=local, offload=offload()
    )
    assert definition == hit


def test_a_state_load_restores_one_slot_and_says_which_t_it_holds() -> None:
    """OFF-6: one block at T / B - 1 from chunk T / C - 1, state_tokens = T; T off the grid is refused (STATE-1)."""
    load = get_load_set(FA_STATE, [[1, 2, 3, 4], [0, 0, 7, 8]], num_tokens=12, local_hit_tokens=4, offload=offload())
    assert load.block_ids == ((2, 3), (7,))
    assert load.first_block_indices == (1, 2)
    assert load.chunk_ranges == ((1, 3), (2, 3))
    assert load.state_tokens == (None, 12)
    with pytest.raises(StatePositionError, match=r"group 1 is a state group of block size 4; expected T a multiple"):
        get_load_set(FA_STATE, [[1, 2, 3, 4], [0, 0, 7, 8]], num_tokens=11, local_hit_tokens=0, offload=offload())
    with pytest.raises(WindowCoverageError, match=r"block_ids\[1\]\[2\]"):
        get_load_set(FA_STATE, [[1, 2, 3, 4], [5, 6, 0, 8]], num_tokens=12, local_hit_tokens=0, offload=offload())
    nothing = get_load_set(FA_STATE, [[1, 2], [5, 6]], num_tokens=8, local_hit_tokens=8, offload=offload())
    assert nothing.state_tokens == (None, None)
    assert nothing.num_blocks == (0, 0)
    with pytest.raises(ConfigError, match=r"LoadSet.state_tokens\[1\]: expected None or a non-negative int"):
        attrs.evolve(load, state_tokens=(None, -1))


@settings(max_examples=40)
@given(case=hit_cases(states=True))
def test_a_state_hit_restores_exactly_the_state_the_resume_point_needs(
    case: tuple[KVCacheConfig, OffloadConfig, list[list[bool]], int, int],
) -> None:
    """Every state group's load is one present chunk whose state absorbed exactly T = C + hit tokens (OFF-5, OFF-6)."""
    config, off_config, present, num_tokens, local = case
    hit = get_offload_hit_tokens(config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config)
    assume(hit > 0)
    t = local + hit
    ids = [list(range(1, num_tokens // g.kv_cache_spec.block_size + 2)) for g in config.kv_cache_groups]
    load = get_load_set(config, ids, num_tokens=t, local_hit_tokens=local, offload=off_config)
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            assert t % spec.block_size == 0
            assert t < num_tokens
            assert present[g][t // spec.block_size - 1]
            assert load.chunk_ranges[g] == (t // spec.block_size - 1, t // spec.block_size)
            assert load.state_tokens[g] == t
            assert load.num_blocks[g] == 1
        else:
            assert load.state_tokens[g] is None


def test_mla_and_sliding_window_mla_are_admitted() -> None:
    mla = MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    sw_mla = SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8)
    config = make_config(mla, sw_mla)
    check_offload_support(config)
    # SW-MLA is a window group: the 13-token pin holds for it too.
    present = [[True] * 3, [False, True, True]]
    assert get_offload_hit_tokens(config, present, num_tokens=13, local_hit_tokens=0, offload=offload()) == 12


def test_mamba_preset_fails_closed() -> None:
    config = get_preset("qwen3-next-80b").build_config(num_blocks=2, max_layers_per_group=1)
    with pytest.raises(UnsupportedHybridError, match=r"kind mamba"):
        check_offload_support(config)


# --------------------------------------------------------------------------- mutants (each killed by a named test)


def negated_skip_map(first: int, count: int, *, blocks_per_chunk: int) -> tuple[tuple[int, int], ...]:
    """The #41445 review's test-helper bug: skip = (-L) % f."""
    skip = -first % blocks_per_chunk
    return tuple(divmod(skip + i, blocks_per_chunk) for i in range(count))


def check_sub_block_pins(impl: Callable[..., tuple[tuple[int, int], ...]]) -> None:
    got = impl(4, 5, blocks_per_chunk=3)
    assert got == ((0, 1), (0, 2), (1, 0), (1, 1), (1, 2)), f"sub-block map broken: {got}"


def test_mutant_negated_skip_is_killed() -> None:
    check_sub_block_pins(map_sub_blocks)
    with pytest.raises(AssertionError, match="sub-block map broken"):
        check_sub_block_pins(negated_skip_map)


def floor_window_hit_end(present: Sequence[bool], *, end: int, local: int, size: int, window: int) -> int:
    """A W // B-style window in chunks: only the last W // C chunks before the end must be present."""
    e = end
    while e - local >= size:
        stop = -(-e // size)
        first = max(local // size, stop - window // size)
        needed = list(present[first:stop])
        if False not in needed:
            return e
        e = (first + len(needed) - 1 - needed[::-1].index(False)) * size
    return local


def check_window_hits(config: KVCacheConfig) -> None:
    # W = 6, C = 4: a hit ending at 12 needs tokens [7, 11], chunks 1 and 2; chunk 1 is absent.
    present = [[True] * 3, [True, False, True]]
    hit = get_offload_hit_tokens(config, present, num_tokens=13, local_hit_tokens=0, offload=offload())
    assert hit == 4, f"window hit broken: {hit}"


def test_mutant_floor_window_in_chunks_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(fa(4), sw(6, 4))
    check_window_hits(config)
    monkeypatch.setattr(off, "_window_hit_end", floor_window_hit_end)
    with pytest.raises(AssertionError, match="window hit broken: 12"):
        check_window_hits(config)


def floor_window_load(config: KVCacheConfig, *, tokens: int, f: int) -> int:
    """The #48959 bound: a window load of at most cdiv(W, C) * f blocks."""
    window = window_of(config, 1)
    assert window is not None
    return -(-window // (config.kv_cache_groups[1].kv_cache_spec.block_size * f)) * f


def test_mutant_window_load_bound_in_chunks_is_killed() -> None:
    config = make_config(fa(32), sw(4096, 32))
    load = get_load_set(
        config, allocation(config, tokens=98012), num_tokens=98012, local_hit_tokens=0, offload=offload(8, 32)
    )
    assert load.num_blocks[1] > floor_window_load(config, tokens=98012, f=8) == 128


def test_mutant_no_n_minus_one_cap_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    def check() -> None:
        hit = get_offload_hit_tokens(FA_SW, [[True] * 3] * 2, num_tokens=12, local_hit_tokens=0, offload=offload())
        assert hit == 11, f"N - 1 cap broken: {hit}"

    check()
    monkeypatch.setattr(off, "_first_hit_end", lambda num_tokens, *, has_window: num_tokens)
    with pytest.raises(AssertionError, match="N - 1 cap broken: 12"):
        check()


def test_mutant_window_group_as_full_attention_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    def check() -> None:
        present = [[True] * 3, [False, True, True]]  # the window's chunk 0 was never stored
        hit = get_offload_hit_tokens(FA_SW, present, num_tokens=13, local_hit_tokens=0, offload=offload())
        assert hit == 12, f"window group broken: hit {hit}"
        load = get_load_set(FA_SW, [[1, 2, 3], [0, 6, 7]], num_tokens=12, local_hit_tokens=0, offload=offload())
        assert load.chunks[1] == (1, 2), f"window group broken: load {load.chunks[1]}"

    check()
    monkeypatch.setattr(off, "_window", lambda spec: None)
    with pytest.raises(AssertionError, match="window group broken: hit 0"):
        check()


def null_counting_store(config: KVCacheConfig, block_ids: Sequence[Sequence[int]], **kwargs: object) -> StoreSet:
    """#42945 before the fix: f block counted per offered chunk, nulls included."""
    store = get_store_set(config, block_ids, **kwargs)  # type: ignore[arg-type]
    return attrs.evolve(store, num_blocks=[len(c) * store.blocks_per_chunk for c in store.chunks])


def test_mutant_null_blocks_counted_is_killed() -> None:
    ids = [list(range(1, 11)), [0, 0, 0, 0, 0, 105, 106, 107, 108, 109]]
    kwargs: dict[str, object] = {"num_offloadable_tokens": 40, "next_chunk": [0, 0], "offload": offload(3)}
    assert get_store_set(FA_SW, ids, **kwargs).num_blocks == (9, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"StoreSet.num_blocks\[1\]: expected 4 .*got 6"):
        null_counting_store(FA_SW, ids, **kwargs)


def test_store_rejects_a_real_id_inside_the_null_prefix() -> None:
    with pytest.raises(ConfigError, match=r"expected null ids \(0\) only as a prefix, got a real id among the first 4"):
        get_store_set(
            make_config(fa(4)), [[0, 5, 0, 0, 7, 8]], num_offloadable_tokens=24, next_chunk=[0], offload=offload()
        )


# --------------------------------------------------------------------------- presets of vLLM's offloading e2e models


def test_mamba_130m_preset_is_one_state_group() -> None:
    config = get_preset("state-spaces/mamba-130m-hf").build_config(num_blocks=4)
    (group,) = config.kv_cache_groups
    assert len(group.layer_names) == 24
    # Conv state (3, 1536) and SSM state (1536, 16) in float32.
    assert group.kv_cache_spec.page_size_bytes == (3 * 1536 + 1536 * 16) * 4
    with pytest.raises(UnsupportedHybridError, match=r"group 0 \(kind mamba"):
        check_offload_support(config)


def test_falcon_h1_preset_pads_attention_to_hold_the_state() -> None:
    config = get_preset("falcon-h1-0.5b").build_config(num_blocks=4)
    attention, state = config.kv_cache_groups
    assert (len(attention.layer_names), len(state.layer_names)) == (36, 36)
    # State: (3 * 1792 + 24 * 64 * 128) bf16 = 403968 bytes; 512 bytes per attention token -> 789 -> 800 tokens.
    assert attention.kv_cache_spec.block_size == state.kv_cache_spec.block_size == 800
    assert attention.kv_cache_spec.page_size_bytes == state.kv_cache_spec.page_size_bytes == 800 * 512
    assert get_chunk_sizes(config, blocks_per_chunk=1, hash_block_size=16) == (800, 800)
    with pytest.raises(UnsupportedHybridError, match=r"group 1 \(kind mamba"):
        check_offload_support(config)


def test_gemma_3_1b_offload_geometry() -> None:
    # vLLM's e2e test runs gemma-3-1b-it with block_size 48 at B = 16: f = 3, 48-token chunks in all 7 groups.
    config = get_preset("gemma-3-1b").build_config(num_blocks=4)
    assert get_chunk_sizes(config, blocks_per_chunk=3, hash_block_size=16) == (48,) * 7


def test_offload_key_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"OffloadKey\.block_hash: expected bytes, got 'ab'"):
        OffloadKey(block_hash="ab", group=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"OffloadKey.group: expected an int in \[0, 2\*\*32\), got -1"):
        OffloadKey(block_hash=b"ab", group=-1)
