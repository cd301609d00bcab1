"""INT-2: the digest over the canonical page agrees across TP, PP and page sizes, and catches what it must."""

from __future__ import annotations

import os
import random

import pytest

from kvspec import FullAttentionSpec, IntegrityMismatchError, MalformedMessageError, MLAAttentionSpec
from kvspec.spec.digest import (
    DigestAlgorithm,
    DigestMode,
    DigestPolicy,
    check_digests,
    choose_digest_algorithm,
    combine_digests,
    digest_rank_page,
    format_digest,
    get_digest_cells,
    get_digest_shape,
    get_partial_ranges,
    is_request_sampled,
    parse_digest,
)
from kvspec.spec.parallel import CanonicalPage, PageOrder, get_canonical_page, get_rank_page_map

GQA = FullAttentionSpec(block_size=8, num_kv_heads=4, head_size=16, dtype="bfloat16")
MLA = MLAAttentionSpec(block_size=8, num_kv_heads=1, head_size=32, dtype="bfloat16")
POLICIES = [DigestPolicy(algorithm=a) for a in DigestAlgorithm] + [DigestPolicy(mode="partial", partial_bytes=40)]


def project(page: CanonicalPage, canonical: bytes, tp_size: int, tp_rank: int) -> bytes:
    """Rank ``tp_rank``'s physical page of a canonical page's bytes (PAR-2)."""
    runs = get_rank_page_map(page, tp_size=tp_size, tp_rank=tp_rank)
    out = bytearray(sum(r.nbytes for r in runs))
    for r in runs:
        out[r.rank_offset : r.rank_offset + r.nbytes] = canonical[r.canonical_offset : r.canonical_offset + r.nbytes]
    return bytes(out)


def engine_total(
    policy: DigestPolicy, page: CanonicalPage, canonical: bytes, tp: int, *, split: int, granule: int, position: int = 0
) -> dict[int, int]:
    """The sum over an engine's TP ranks of their digests of one page."""
    return combine_digests(
        digest_rank_page(
            policy,
            page,
            project(page, canonical, tp, rank),
            layer="model.layers.0",
            position=position,
            tp_size=tp,
            tp_rank=rank,
            split=split,
            granule=granule,
        )
        for rank in range(tp)
    )


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.algorithm.value}-{p.mode.value}")
@pytest.mark.parametrize("order", [PageOrder.HND, PageOrder.NHD])
@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 1), (1, 2), (4, 1), (2, 8), (8, 2)])
def test_any_tp_pair_agrees_on_the_same_canonical_page(
    policy: DigestPolicy, order: PageOrder, spec: FullAttentionSpec, producer_tp: int, consumer_tp: int
) -> None:
    page = get_canonical_page(spec, order=order)
    canonical = random.Random(f"{producer_tp}{consumer_tp}").randbytes(page.nbytes)
    split, granule = get_digest_shape(
        producer_tp=producer_tp, consumer_tp=consumer_tp, producer_block_size=8, consumer_block_size=8
    )
    held = engine_total(policy, page, canonical, producer_tp, split=split, granule=granule)
    assert engine_total(policy, page, canonical, consumer_tp, split=split, granule=granule) == held
    flipped = bytearray(canonical)
    flipped[0] ^= 1  # the first byte is digested in every mode
    with pytest.raises(IntegrityMismatchError, match=r"group 0, tokens \[0, 8\).*\(INT-2\)"):
        check_digests(
            "r", held, engine_total(policy, page, bytes(flipped), consumer_tp, split=split, granule=granule), granule=8
        )


def test_a_page_of_32_tokens_agrees_with_two_of_16() -> None:
    big_spec, small_spec = (
        FullAttentionSpec(block_size=b, num_kv_heads=2, head_size=16, dtype="float16") for b in (32, 16)
    )
    big, small = get_canonical_page(big_spec), get_canonical_page(small_spec)
    canonical = os.urandom(big.nbytes)
    # Canonical HND: [k|v][head][token][channel]; the 16-token pages take each half of the token axis.
    row, rows = 16 * 2, 32
    halves = [
        b"".join(
            canonical[(unit * rows + first) * row : (unit * rows + first + 16) * row] for unit in range(4)
        )  # 2 tensors x 2 heads
        for first in (0, 16)
    ]
    split, granule = get_digest_shape(producer_tp=1, consumer_tp=1, producer_block_size=16, consumer_block_size=32)
    policy = DigestPolicy()
    consumer = engine_total(policy, big, canonical, 1, split=split, granule=granule)
    producer = combine_digests(
        engine_total(policy, small, halves[i], 1, split=split, granule=granule, position=16 * i) for i in range(2)
    )
    assert producer == consumer
    assert list(consumer) == [0, 16]
    swapped = combine_digests(
        engine_total(policy, small, halves[1 - i], 1, split=split, granule=granule, position=16 * i) for i in range(2)
    )
    with pytest.raises(IntegrityMismatchError, match=r"tokens \[0, 16\)"):
        check_digests("r", producer, swapped, granule=16)  # pages in each other's slots


def test_partial_mode_binds_size_and_position_and_misses_only_unsampled_bytes() -> None:
    policy = DigestPolicy(mode=DigestMode.PARTIAL, partial_bytes=16)
    page = get_canonical_page(GQA)
    canonical = os.urandom(page.nbytes)
    held = engine_total(policy, page, canonical, 1, split=1, granule=8)
    cells = get_digest_cells(page, split=1, granule=8)
    middle = bytearray(canonical)
    middle[cells[0].nbytes // 2] ^= 0xFF  # not among the 4 + 4 bytes at the cell's ends: missed, as stated
    assert engine_total(policy, page, bytes(middle), 1, split=1, granule=8) == held
    tail = bytearray(canonical)
    tail[cells[0].nbytes - 1] ^= 0xFF  # the cell's last byte is sampled
    assert engine_total(policy, page, bytes(tail), 1, split=1, granule=8) != held
    # The same bytes at another position, or a page of another size with equal ends, digest differently.
    assert engine_total(policy, page, canonical, 1, split=1, granule=8, position=8) != {8: held[0]}
    longer = get_canonical_page(FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype="bfloat16"))
    assert engine_total(policy, longer, canonical + canonical, 1, split=1, granule=16)[0] != held[0]
    assert get_partial_ranges(10, 5) == ((0, 3), (8, 2))
    assert get_partial_ranges(4, 9) == ((0, 4),)


def test_a_swap_of_two_cells_is_caught_though_the_sum_commutes() -> None:
    page = get_canonical_page(GQA)
    canonical = os.urandom(page.nbytes)
    half = page.nbytes // 2
    swapped = canonical[half:] + canonical[:half]  # K and V exchanged
    held = engine_total(DigestPolicy(), page, canonical, 1, split=1, granule=8)
    assert engine_total(DigestPolicy(), page, swapped, 1, split=1, granule=8) != held


def test_sampling_is_seeded_and_deterministic() -> None:
    ids = [f"req-{i}" for i in range(2000)]
    half = DigestPolicy(mode="sampled", sample_ppm=500_000, seed=7)
    chosen = [i for i in ids if is_request_sampled(half, i)]
    assert chosen == [i for i in ids if is_request_sampled(DigestPolicy(mode="sampled", sample_ppm=500_000, seed=7), i)]
    assert 850 < len(chosen) < 1150
    assert chosen != [i for i in ids if is_request_sampled(DigestPolicy(mode="sampled", sample_ppm=500_000, seed=8), i)]
    assert not any(is_request_sampled(DigestPolicy(mode="sampled", sample_ppm=0), i) for i in ids[:50])
    assert all(is_request_sampled(DigestPolicy(mode="full", sample_ppm=0), i) for i in ids[:50])


def test_negotiation_and_the_text_form() -> None:
    assert choose_digest_algorithm(["blake2b-128", "xxh3-128"], ["xxh3-128"]) is DigestAlgorithm.XXH3_128
    assert choose_digest_algorithm(["blake2b-128"], ["xxh3-128", "blake2b-128"]) is DigestAlgorithm.BLAKE2B_128
    assert choose_digest_algorithm(["blake2b-128"], ["sha1"]) is None
    assert parse_digest(format_digest(5), field="d") == 5
    assert len(format_digest(2**128 - 1)) == 32
    for bad in ("A" * 32, "0" * 31, 5, "0" * 10_000):
        with pytest.raises(MalformedMessageError, match="d: expected 32 lowercase hex"):
            parse_digest(bad, field="d")
    with pytest.raises(ValueError, match="partial_bytes"):
        DigestPolicy(partial_bytes=0)
    with pytest.raises(ValueError, match="algorithm"):
        DigestPolicy(algorithm="crc32")
