"""The offload oracle's own arithmetic agrees with the spec's tables and, on generated inputs, with the reference.

The suite judges a hit by kvspec's plain OFF-5; the brute force here checks that definition token by token.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvspec_conformance._offload_oracle import is_state_group, window_of
from kvspec_conformance._offload_scenario import chunk_pool_config, expected_load_positions
from kvspec_conformance.configs import full, make_config, sw

from kvspec import KVCacheConfig, OffloadConfig, get_load_set, get_offload_hit_tokens, get_sub_block_offset

FULL_SW = make_config(full(4), sw(8, 4), num_blocks=64)
MIXED = make_config(full(12), full(16), num_blocks=64)


def expected_hit_tokens(
    config: KVCacheConfig, present: Sequence[Sequence[bool]], *, num_tokens: int, local_hit_tokens: int, f: int
) -> int:
    """OFF-5 by brute force: the largest end every group supports, scanned token by token (OFF-5).

    The tests' own model of kvspec's plain definition, which the suite uses.

    An end ``e`` is supported when, for every group, each chunk holding a
    token of ``[C, e)`` (full attention) or ``[max(C, e - W + 1), e)`` (a
    window) is present, and ``e - C`` is at least one chunk. It starts at
    ``N`` (``N - 1`` with a window or state group) and at most the keys so
    far. A state group supports ``e`` only when ``e`` ends one of its chunks
    and that chunk is present: the state after exactly ``e`` tokens.
    """
    c = local_hit_tokens
    sizes = [group.kv_cache_spec.block_size * f for group in config.kv_cache_groups]
    windows = [window_of(config, g) for g in range(config.num_groups)]
    states = [is_state_group(config, g) for g in range(config.num_groups)]
    end = num_tokens - 1 if any(w is not None for w in windows) or any(states) else num_tokens
    end = min([end, *(len(p) * size for p, size in zip(present, sizes, strict=True))])
    for e in range(end, c, -1):
        if any(e - c < size for size in sizes):
            return 0
        supported = True
        for g, (size, window) in enumerate(zip(sizes, windows, strict=True)):
            if states[g]:
                if e % size or not present[g][e // size - 1]:
                    supported = False
                    break
                continue
            first = c if window is None else max(c, e - window + 1)
            if first < e and not all(present[g][t // size] for t in range(first, e)):
                supported = False
                break
        if supported:
            return e - c
    return 0


def test_hits_of_the_spec_table() -> None:
    # docs/spec/offload.md, OFF-5 (vLLM's HMA tests and the B = (12, 16) test).
    present = [[True] * 6, [True] * 6]
    assert expected_hit_tokens(FULL_SW, [p[:3] for p in present], num_tokens=13, local_hit_tokens=0, f=1) == 12
    assert expected_hit_tokens(FULL_SW, [p[:4] for p in present], num_tokens=17, local_hit_tokens=12, f=1) == 4
    assert expected_hit_tokens(FULL_SW, [p[:3] for p in present], num_tokens=12, local_hit_tokens=0, f=1) == 11
    window_gaps = [[True] * 6, [True, True, True, False, True, False]]
    assert expected_hit_tokens(FULL_SW, window_gaps, num_tokens=25, local_hit_tokens=0, f=1) == 12
    assert expected_hit_tokens(MIXED, [[True] * 4, [True] * 3], num_tokens=48, local_hit_tokens=0, f=1) == 48
    assert expected_hit_tokens(MIXED, [[True] * 7, [True] * 5], num_tokens=85, local_hit_tokens=48, f=1) == 32
    mixed_window = make_config(full(12), sw(16, 16), num_blocks=64)
    assert (
        expected_hit_tokens(mixed_window, [[True] * 3, [True, False, True]], num_tokens=48, local_hit_tokens=0, f=1)
        == 16
    )


def test_load_positions_of_the_spec_table() -> None:
    # docs/explanation/offload-and-vllm.md, worked values, OFF-6.
    assert expected_load_positions(FULL_SW, num_tokens=12, local_hit_tokens=0) == [range(0, 3), range(1, 3)]
    assert expected_load_positions(FULL_SW, num_tokens=16, local_hit_tokens=12) == [range(3, 4), range(3, 4)]
    assert expected_load_positions(MIXED, num_tokens=80, local_hit_tokens=48) == [range(4, 7), range(3, 5)]


def test_chunk_pool_layout_is_off_7() -> None:
    config = chunk_pool_config(FULL_SW, rows=5, blocks_per_chunk=3)
    page = FULL_SW.kv_cache_groups[1].kv_cache_spec.page_size_bytes
    for row in range(5):
        for sub in range(3):
            region, offset = config.page_offset("g1.l1", row * 3 + sub)
            assert region == 3
            assert offset == get_sub_block_offset(row, sub, page_size=page, blocks_per_chunk=3)


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 24),
    f=st.integers(1, 4),
    n=st.integers(0, 80),
    local_blocks=st.integers(0, 20),
    data=st.data(),
)
@example(window=8, f=3, n=25, local_blocks=0, data=None)  # the OFF-4 example's reader
@example(window=16, f=1, n=48, local_blocks=0, data=None)
def test_brute_force_hit_and_load_agree_with_the_reference(
    window: int, f: int, n: int, local_blocks: int, data: st.DataObject | None
) -> None:
    config = make_config(full(4), sw(window, 4), num_blocks=64)
    offload = OffloadConfig(blocks_per_chunk=f, hash_block_size=4)
    local = min(4 * local_blocks, (n // 4) * 4)
    keys = n // (4 * f)
    if data is None:
        present = [[True] * keys, [k != 1 for k in range(keys)]]
    else:
        present = [data.draw(st.lists(st.booleans(), min_size=keys, max_size=keys)) for _ in range(2)]
    hit = get_offload_hit_tokens(config, present, num_tokens=n, local_hit_tokens=local, offload=offload)
    assert expected_hit_tokens(config, present, num_tokens=n, local_hit_tokens=local, f=f) == hit
    if hit:
        ids = [list(range(1, -(-(local + hit) // 4) + 1))] * 2
        load = get_load_set(config, ids, num_tokens=local + hit, local_hit_tokens=local, offload=offload)
        loaded = [
            range(first, first + count) for first, count in zip(load.first_block_indices, load.num_blocks, strict=True)
        ]
        assert loaded == expected_load_positions(config, num_tokens=local + hit, local_hit_tokens=local)
