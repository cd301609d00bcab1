"""Many ranks, one canonical page: PAR-1 .. PAR-9 (kvspec/spec/parallel.py), their pins, and a mutant per rule.

The planner's copies must tile every consumer rank's page exactly once from one
source (PAR-3, PAR-4) for TP pairs over {1, 2, 4, 8} both ways; the 496 head
cases and the GDN cases on which vLLM 0.33 and SGLang 0.5.23 agree are checked
against an independent model; the #55208 configuration is pinned with the
ratio-scaled mapping as a mutant the coverage rule refuses.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvspec.spec.parallel as par
from kvspec import ParallelismError
from kvspec.cli import main
from kvspec.presets import get_preset
from kvspec.spec.parallel import (
    CanonicalPage,
    PageOrder,
    PageTensor,
    ParallelLayout,
    RankCopy,
    RankLayout,
    SubBlock,
    check_coverage,
    compute_dcp_copies,
    compute_rank_copies,
    elect_source_rank,
    get_candidate_ranks,
    get_completion_count,
    get_dcp_owner,
    get_dcp_token_position,
    get_layout_mismatch,
    get_owned_units,
    get_rank_page_map,
    pair_stage_layers,
)

SIZES = (1, 2, 4, 8)


def canonical_units(page: CanonicalPage, tp: int, rank: int, copies: Sequence[RankCopy], *, producer: bool) -> set[int]:
    """Every canonical byte the copies touch on one side (for the exactly-once checks)."""
    runs = get_rank_page_map(page, tp_size=tp, tp_rank=rank)
    found: set[int] = set()
    for copy in copies:
        offset = copy.producer_offset if producer else copy.consumer_offset
        for at in range(offset, offset + copy.nbytes):
            run = next(r for r in runs if r.rank_offset <= at < r.rank_offset + r.nbytes)
            found.add(run.canonical_offset + at - run.rank_offset)
    return found


def kv_page(heads: int, *, order: PageOrder = PageOrder.HND, rows: int = 2, element: int = 2) -> CanonicalPage:
    kv = [SubBlock(name="kv_heads", extent=heads)]
    return CanonicalPage(
        tensors=[PageTensor(name=n, sub_blocks=kv, rows=rows, element_bytes=element, order=order) for n in "kv"]
    )


def mamba2_page(groups: int, *, heads: int = 8, order: PageOrder = PageOrder.HND) -> CanonicalPage:
    conv = [
        SubBlock(name="x", extent=heads, width=2),
        SubBlock(name="B", extent=groups, width=3),
        SubBlock(name="C", extent=groups, width=3),
    ]
    return CanonicalPage(
        tensors=[
            PageTensor(name="conv", sub_blocks=conv, rows=3, element_bytes=1, order=order),
            PageTensor(name="ssm", sub_blocks=[SubBlock(name="heads", extent=heads)], rows=1, element_bytes=4),
        ]
    )


def check_plan(page: CanonicalPage, producer_tp: int, consumer_tp: int) -> None:
    """Every consumer rank: tiled exactly once (PAR-3), from ranks it faces (PAR-4, PAR-6)."""
    for consumer_rank in range(consumer_tp):
        copies = compute_rank_copies(
            page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank
        )
        check_coverage(
            page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank, copies=copies
        )
        faced = get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank)
        assert {c.producer_rank for c in copies} <= set(faced)
        landed = sum(c.nbytes for c in copies)
        assert landed == sum(r.nbytes for r in get_rank_page_map(page, tp_size=consumer_tp, tp_rank=consumer_rank))


# --------------------------------------------------------------------------- PAR-1, PAR-2


@st.composite
def pages(draw: st.DrawFn) -> CanonicalPage:
    """Pages whose sub-block extents divide or are divided by every TP size in SIZES."""
    tensors = []
    for t in range(draw(st.integers(1, 3))):
        blocks = [
            SubBlock(
                name=f"b{t}{i}",
                extent=draw(st.sampled_from((1, 2, 4, 8, 16))),
                width=draw(st.integers(1, 3)),
                replicated=draw(st.booleans()),
            )
            for i in range(draw(st.integers(1, 3)))
        ]
        order = draw(st.sampled_from((PageOrder.HND, PageOrder.NHD)))
        rows, element = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        tensors.append(PageTensor(name=f"t{t}", sub_blocks=blocks, rows=rows, element_bytes=element, order=order))
    return CanonicalPage(tensors=tensors)


@settings(max_examples=25, deadline=None)
@given(page=pages(), producer_tp=st.sampled_from(SIZES), consumer_tp=st.sampled_from(SIZES))
def test_every_consumer_rank_is_tiled_exactly_once_from_one_source(
    page: CanonicalPage, producer_tp: int, consumer_tp: int
) -> None:
    check_plan(page, producer_tp, consumer_tp)
    # The ranks of one engine together hold the whole canonical page (PAR-2).
    held = set()
    for rank in range(producer_tp):
        for run in get_rank_page_map(page, tp_size=producer_tp, tp_rank=rank):
            held |= set(range(run.canonical_offset, run.canonical_offset + run.nbytes))
    assert held == set(range(page.nbytes))


def test_ownership_splits_replicates_and_refuses_by_name() -> None:
    heads = SubBlock(name="kv_heads", extent=8)
    assert [get_owned_units(heads, tp_size=4, tp_rank=r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    two = SubBlock(name="kv_heads", extent=2)
    assert [get_owned_units(two, tp_size=4, tp_rank=r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    latent = SubBlock(name="latent", extent=1, replicated=True)
    assert get_owned_units(latent, tp_size=8, tp_rank=7) == (0, 1)
    with pytest.raises(ParallelismError, match=r"kv_heads\.extent: expected a multiple or a divisor of tp_size 2"):
        get_owned_units(SubBlock(name="kv_heads", extent=5), tp_size=2, tp_rank=0)
    with pytest.raises(ParallelismError, match="tp_rank: expected below tp_size 2"):
        RankLayout(tp_size=2, tp_rank=2)
    with pytest.raises(ParallelismError, match=r"tp_rank: expected in \[0, 4\)"):
        get_owned_units(heads, tp_size=4, tp_rank=4)
    with pytest.raises(ParallelismError, match=r"PageTensor\.order: expected one of \['hnd', 'nhd', 'opaque'\]"):
        PageTensor(name="k", sub_blocks=[heads], rows=1, element_bytes=1, order="hdn")
    assert RankLayout(layers="layers.0").layers == ("layers.0",)
    with pytest.raises(ParallelismError, match="consumer_tp: expected a multiple or a divisor of producer_tp 2"):
        compute_rank_copies(kv_page(2), producer_tp=2, consumer_tp=3, consumer_rank=0)


# --------------------------------------------------------------------------- the differential's 496 head cases


def vllm_model_sources(heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int) -> dict[int, int]:
    """Head -> producer rank, as the research differential's independent model (and vLLM 0.33, SGLang) read them."""

    def owned(tp: int, rank: int) -> list[int]:
        return list(range(rank * heads // tp, (rank + 1) * heads // tp)) if tp <= heads else [rank * heads // tp]

    if consumer_tp >= producer_tp:
        source = consumer_rank * producer_tp // consumer_tp
        return dict.fromkeys(owned(consumer_tp, consumer_rank), source)
    ratio = producer_tp // consumer_tp
    found: dict[int, int] = {}
    for rank in range(consumer_rank * ratio, (consumer_rank + 1) * ratio):
        for head in owned(producer_tp, rank):
            found.setdefault(head, rank)  # deduplicated by unique head: the first rank holding it
    return found


HEAD_CASES = [
    (k, p, d, c) for k in (1, 2, 4, 8) for p, d in itertools.permutations((1, 2, 4, 8, 16), 2) for c in range(d)
]


def test_the_differential_has_496_head_cases() -> None:
    assert len(HEAD_CASES) == 496


def test_the_496_head_cases_match_the_engines_model() -> None:
    for heads, p, d, c in HEAD_CASES:
        page = kv_page(heads, rows=1, element=1)
        copies = compute_rank_copies(page, producer_tp=p, consumer_tp=d, consumer_rank=c)
        check_coverage(page, producer_tp=p, consumer_tp=d, consumer_rank=c, copies=copies)
        got: dict[int, int] = {}
        for copy in copies:
            for canonical in canonical_units(page, p, copy.producer_rank, [copy], producer=True):
                got[canonical % heads] = copy.producer_rank  # K bytes are heads 0..K-1, V the same heads again
        assert got == vllm_model_sources(heads, p, d, c), (heads, p, d, c)


# --------------------------------------------------------------------------- state groups


@pytest.mark.parametrize("groups_per_tp", [False, True], ids=["n_groups_1", "n_groups_tp"])
@pytest.mark.parametrize(("producer_tp", "consumer_tp"), list(itertools.product(SIZES, SIZES)))
def test_mamba2_with_n_groups_1_and_n_groups_tp(groups_per_tp: bool, producer_tp: int, consumer_tp: int) -> None:
    groups = max(producer_tp, consumer_tp) if groups_per_tp else 1
    for order in (PageOrder.HND, PageOrder.NHD):  # conv DS and SD
        check_plan(mamba2_page(groups, order=order), producer_tp, consumer_tp)


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_gdn_conv_channels_match_the_independent_model(producer_tp: int, consumer_tp: int) -> None:
    # The differential's GDN case: [Q, K, V] = 8, 8, 16 channels, each sharded on its own.
    widths = {"q": 8, "k": 8, "v": 16}
    conv = [SubBlock(name=n, extent=w) for n, w in widths.items()]
    page = CanonicalPage(tensors=[PageTensor(name="conv", sub_blocks=conv, rows=1, element_bytes=1)])
    starts = {"q": 0, "k": 8, "v": 16}
    for c in range(consumer_tp):
        copies = compute_rank_copies(page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=c)
        moved = canonical_units(page, producer_tp, 0, [], producer=True)
        for copy in copies:
            moved |= canonical_units(page, producer_tp, copy.producer_rank, [copy], producer=True)
        expected = {
            starts[n] + ch for n, w in widths.items() for ch in range(c * w // consumer_tp, (c + 1) * w // consumer_tp)
        }
        assert moved == expected


def test_gdn_and_kda_presets_tile_for_every_tp_pair() -> None:
    for alias in ("qwen3-next-80b", "kimi-linear-48b", "nemotron-h-8b", "falcon-h1-0.5b"):
        preset = get_preset(alias)
        config = preset.build_config(num_blocks=2)
        for group in config.kv_cache_groups[-2:]:
            page = preset.get_canonical_page(group.kv_cache_spec)
            for p, d in [(1, 4), (4, 1), (2, 8)]:
                check_plan(page, p, d)


def test_mla_latent_is_read_once_and_unread_ranks_are_still_notified() -> None:
    latent = SubBlock(name="latent", extent=1, replicated=True)
    page = CanonicalPage(tensors=[PageTensor(name="latent", sub_blocks=[latent], rows=4, element_bytes=8)])
    check_plan(page, 4, 2)
    copies = compute_rank_copies(page, producer_tp=4, consumer_tp=2, consumer_rank=1)
    assert {c.producer_rank for c in copies} == {2}  # one source: rank 3 holds the same latent and is not read
    # ... yet rank 3 frees only after its one notification (PAR-6).
    assert [get_completion_count(producer_tp=4, consumer_tp=2, producer_rank=p) for p in range(4)] == [1, 1, 1, 1]
    assert [get_completion_count(producer_tp=1, consumer_tp=4, producer_rank=0)] == [4]


# --------------------------------------------------------------------------- mutants, one per rule


def ratio_scaled_conv_copies(page: CanonicalPage, consumer_tp: int, consumer_rank: int) -> list[RankCopy]:
    """vLLM 0.33's remote_conv_offsets, P TP1 -> D TP-D: every sub-block taken as sharded, so its remote start is
    the consumer's local start times the ratio, plus the rank times its local width (#55208)."""
    conv, ssm = page.tensors
    copies, c_at = [], 0
    for block in conv.sub_blocks:
        start, end = get_owned_units(block, tp_size=consumer_tp, tp_rank=consumer_rank)
        local = (end - start) * block.width * conv.element_bytes * conv.rows
        copies.append(
            RankCopy(
                producer_rank=0,
                consumer_rank=consumer_rank,
                producer_offset=consumer_tp * c_at + consumer_rank * local,
                consumer_offset=c_at,
                nbytes=local,
            )
        )
        c_at += local
    p_at = sum(b.extent * b.width for b in conv.sub_blocks) * conv.element_bytes * conv.rows
    heads = ssm.sub_blocks[0]
    start, end = get_owned_units(heads, tp_size=consumer_tp, tp_rank=consumer_rank)
    nbytes = (end - start) * ssm.element_bytes
    copies.append(
        RankCopy(
            producer_rank=0,
            consumer_rank=consumer_rank,
            producer_offset=p_at + start * ssm.element_bytes,
            consumer_offset=c_at,
            nbytes=nbytes,
        )
    )
    return copies


def issue_55208_page() -> CanonicalPage:
    # The report's numbers: x 1024 channels (16 heads x 64), B = C = 128 channels (n_groups 1), 3 taps, fp16.
    conv = [
        SubBlock(name="x", extent=16, width=64),
        SubBlock(name="B", extent=1, width=128),
        SubBlock(name="C", extent=1, width=128),
    ]
    return CanonicalPage(
        tensors=[
            PageTensor(name="conv", sub_blocks=conv, rows=1, element_bytes=3 * 2),
            PageTensor(name="ssm", sub_blocks=[SubBlock(name="heads", extent=16)], rows=1, element_bytes=64 * 128 * 2),
        ]
    )


def test_issue_55208_ratio_scaled_sub_blocks_are_refused_by_coverage() -> None:
    page = issue_55208_page()
    naive = ratio_scaled_conv_copies(page, 2, 1)
    # The pinned bytes of the report: rank 1 reads B from [6912, 7680), which is P's C, and C from [8448, 9216).
    assert [(c.producer_offset, c.producer_offset + c.nbytes) for c in naive[1:3]] == [(6912, 7680), (8448, 9216)]
    for rank in (0, 1):
        with pytest.raises(ParallelismError, match=r"copies\[[12]\]: reads canonical bytes .* \(PAR-3\)"):
            check_coverage(
                page, producer_tp=1, consumer_tp=2, consumer_rank=rank, copies=ratio_scaled_conv_copies(page, 2, rank)
            )
    # The plan reads its half of x and B and C whole (one run: they follow each other on both sides), then its heads.
    plan = compute_rank_copies(page, producer_tp=1, consumer_tp=2, consumer_rank=1)
    check_coverage(page, producer_tp=1, consumer_tp=2, consumer_rank=1, copies=plan)
    assert [(c.producer_offset, c.consumer_offset, c.nbytes) for c in plan] == [
        (3072, 0, 3072 + 2 * 768),
        (7680 + 8 * 16384, 4608, 8 * 16384),
    ]


def test_a_head_offset_one_off_is_refused() -> None:
    page = kv_page(8)
    copies = compute_rank_copies(page, producer_tp=1, consumer_tp=4, consumer_rank=1)
    shifted = [attrs.evolve(c, producer_offset=c.producer_offset + 4) for c in copies]  # one head further
    with pytest.raises(ParallelismError, match="PAR-3"):
        check_coverage(page, producer_tp=1, consumer_tp=4, consumer_rank=1, copies=shifted)


def test_replicas_written_twice_overlap() -> None:
    page = kv_page(2)
    copies = list(compute_rank_copies(page, producer_tp=8, consumer_tp=2, consumer_rank=0))
    # Every producer rank holding head 0 writes it, not only the elected one (PAR-4).
    twice = copies + [attrs.evolve(c, producer_rank=1) for c in copies]
    with pytest.raises(ParallelismError, match="consumer rank 0: overlap at byte 0"):
        check_coverage(page, producer_tp=8, consumer_tp=2, consumer_rank=0, copies=twice)
    short = [*copies[:-1], attrs.evolve(copies[-1], nbytes=copies[-1].nbytes - 1)]
    with pytest.raises(ParallelismError, match="gap at byte"):
        check_coverage(page, producer_tp=8, consumer_tp=2, consumer_rank=0, copies=short)


def test_freeing_at_the_first_notification_frees_under_a_reader() -> None:
    # TP1 -> TP4: all four consumer ranks read rank 0; a producer that frees after one notification frees while
    # three of them may still read (PAR-6).
    readers = {
        c
        for c in range(4)
        for copy in compute_rank_copies(kv_page(2), producer_tp=1, consumer_tp=4, consumer_rank=c)
        if copy.producer_rank == 0
    }
    mutant_count = 1
    assert get_completion_count(producer_tp=1, consumer_tp=4, producer_rank=0) == len(readers) == 4 > mutant_count


def test_layers_pair_by_name_and_positional_pairing_is_wrong() -> None:
    # PP2 -> PP1 where the producer's stages are listed in the order their layers come.
    producer = [["layers.2", "layers.3"], ["layers.0", "layers.1"]]
    pairs = pair_stage_layers(producer, [["layers.0", "layers.1", "layers.2", "layers.3"]])
    assert [(p.producer_stage, p.layers) for p in pairs] == [
        (0, ("layers.2", "layers.3")),
        (1, ("layers.0", "layers.1")),
    ]
    positional = {name: i // 2 for i, name in enumerate(["layers.0", "layers.1", "layers.2", "layers.3"])}
    by_name = {name: p.producer_stage for p in pairs for name in p.layers}
    assert positional != by_name  # the mutant pairs layers.0 with stage 0, which holds layers.2 (#15900)
    with pytest.raises(ParallelismError, match=r"consumer_stages\[0\]: layer 'layers.4' is held by no producer stage"):
        pair_stage_layers(producer, [["layers.4"]])
    with pytest.raises(ParallelismError, match=r"layer 'layers.2' already held by stage 0"):
        pair_stage_layers([["layers.2"], ["layers.2"]], [["layers.2"]])


def test_an_opaque_tensor_moves_whole_or_is_refused_by_name() -> None:
    page = kv_page(4, order=PageOrder.OPAQUE)
    check_plan(page, 2, 2)
    with pytest.raises(ParallelismError, match=r"k\.order: expected 'hnd' or 'nhd' .* got 'opaque' \(PAR-5\)"):
        compute_rank_copies(page, producer_tp=1, consumer_tp=2, consumer_rank=0)


@settings(max_examples=50, deadline=None)
@given(size=st.sampled_from((1, 2, 4, 8)), interleave=st.sampled_from((1, 2, 16)), tokens=st.integers(1, 64))
def test_dcp_tokens_go_round_the_ranks_once(size: int, interleave: int, tokens: int) -> None:
    # Every canonical token of a block lies on exactly one DCP rank, and the map inverts (PAR-8).
    seen = set()
    for rank in range(size):
        for local in range(tokens):
            position = get_dcp_token_position(local, dcp_size=size, dcp_rank=rank, interleave=interleave)
            assert get_dcp_owner(position, dcp_size=size, interleave=interleave) == (rank, local)
            seen.add(position)
    assert len(seen) == size * tokens


# --------------------------------------------------------------------------- the command line


def test_kvspec_plan_gives_the_per_rank_plan_for_qwen3_next_tp1_to_tp4() -> None:
    out = io.StringIO()
    argv = ["plan", "qwen3-next-80b", "--tokens", "131072", "--producer-tp", "1", "--consumer-tp", "4", "--json"]
    assert main(argv, out=out) == 0
    plan = json.loads(out.getvalue())
    assert [r["rank"] for r in plan["consumer_ranks"]] == [0, 1, 2, 3]
    assert plan["producer"]["completion_counts"] == [4]
    for rank in plan["consumer_ranks"]:
        attention = [r for r in rank["reads"] if r["kind"] == "full_attention"]
        # 2 KV heads over 4 ranks: each rank holds one head, K and V (544 tokens x 256 x bf16 each).
        assert [r["bytes_per_page"] for r in attention] == [2 * 544 * 256 * 2]
        assert rank["bytes"] == sum(r["bytes"] for r in rank["reads"])
    text = io.StringIO()
    assert main(argv[:-1], out=text) == 0
    assert "consumer rank 3:" in text.getvalue()


# --------------------------------------------------------------------------- DCP: the oracle on the canonical block


def canonical_row(page: CanonicalPage, offset: int) -> tuple[PageTensor, int, int]:
    """The tensor, row and row stride of a canonical byte (for moving it to another row)."""
    base = 0
    for tensor in page.tensors:
        units = [b.extent * b.width * tensor.element_bytes for b in tensor.sub_blocks]
        size = tensor.rows * sum(units)
        if offset < base + size:
            inside = offset - base
            if tensor.order is PageOrder.NHD:
                return tensor, inside // sum(units), sum(units)
            for block, width in zip(tensor.sub_blocks, units, strict=True):
                if inside < tensor.rows * width:
                    unit_bytes = block.width * tensor.element_bytes
                    return tensor, (inside % (tensor.rows * unit_bytes)) // unit_bytes, unit_bytes
                inside -= tensor.rows * width
        base += size
    raise AssertionError(offset)


def run_dcp_oracle(page: CanonicalPage, p: int, d: int, size: int, interleave: int) -> None:
    """Fill the canonical block (``size`` producer pages), project it into every producer rank's pages, run each
    consumer rank's copies, and compare its page with its own projection of the block (PAR-2, PAR-3, PAR-8)."""
    producer = {}
    for rank in range(p):
        for number in range(size):
            labels: dict[int, tuple[int, int]] = {}
            for run in get_rank_page_map(page, tp_size=p, tp_rank=rank):
                labels |= {run.rank_offset + i: (number, run.canonical_offset + i) for i in range(run.nbytes)}
            producer[rank, number] = labels
    for c in range(d):
        for dcp in range(size):
            copies = compute_dcp_copies(
                page, producer_tp=p, consumer_tp=d, consumer_rank=c, dcp_size=size, dcp_rank=dcp, interleave=interleave
            )
            got = {}
            for copy in copies:
                for i in range(copy.nbytes):
                    assert copy.consumer_offset + i not in got, "a byte written twice"
                    got[copy.consumer_offset + i] = producer[copy.producer_rank, copy.producer_page][
                        copy.producer_offset + i
                    ]
            expected = {}
            for run in get_rank_page_map(page, tp_size=d, tp_rank=c):
                for i in range(run.nbytes):
                    tensor, row, stride = canonical_row(page, run.canonical_offset + i)
                    if not tensor.token_rows:
                        expected[run.rank_offset + i] = (0, run.canonical_offset + i)
                        continue
                    token = get_dcp_token_position(row, dcp_size=size, dcp_rank=dcp, interleave=interleave)
                    number, new_row = divmod(token, tensor.rows)
                    expected[run.rank_offset + i] = (number, run.canonical_offset + i + (new_row - row) * stride)
            assert got == expected, (p, d, c, size, dcp)


@pytest.mark.parametrize("order", [PageOrder.HND, PageOrder.NHD])
@pytest.mark.parametrize(("p", "d", "size", "interleave"), [(1, 2, 2, 1), (2, 1, 4, 2), (4, 2, 2, 4), (1, 1, 4, 1)])
def test_dcp_consumer_ranks_get_their_interleaved_tokens(
    order: PageOrder, p: int, d: int, size: int, interleave: int
) -> None:
    kv = [SubBlock(name="kv_heads", extent=2)]
    state = PageTensor(name="ssm", sub_blocks=[SubBlock(name="heads", extent=4)], rows=1, element_bytes=2)
    tensors = [PageTensor(name=n, sub_blocks=kv, rows=4, element_bytes=2, order=order, token_rows=True) for n in "kv"]
    run_dcp_oracle(CanonicalPage(tensors=[*tensors, state]), p, d, size, interleave)


@settings(max_examples=10, deadline=None)
@given(page=pages(), producer_tp=st.sampled_from(SIZES), consumer_tp=st.sampled_from(SIZES))
def test_dcp_of_one_is_the_tp_plan(page: CanonicalPage, producer_tp: int, consumer_tp: int) -> None:
    for c in range(consumer_tp):
        tp = compute_rank_copies(page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=c)
        dcp = compute_dcp_copies(
            page,
            producer_tp=producer_tp,
            consumer_tp=consumer_tp,
            consumer_rank=c,
            dcp_size=1,
            dcp_rank=0,
            interleave=1,
        )
        assert dcp == tp


def test_the_oracle_catches_a_dcp_rank_reading_the_wrong_interleave() -> None:
    kv = [SubBlock(name="kv_heads", extent=1)]
    page = CanonicalPage(tensors=[PageTensor(name="k", sub_blocks=kv, rows=4, element_bytes=1, token_rows=True)])
    good = compute_dcp_copies(page, producer_tp=1, consumer_tp=1, consumer_rank=0, dcp_size=2, dcp_rank=1, interleave=2)
    bad = compute_dcp_copies(page, producer_tp=1, consumer_tp=1, consumer_rank=0, dcp_size=2, dcp_rank=1, interleave=1)
    assert good != bad  # interleave 2: tokens 2, 3, 6, 7 (page 0 rows 2, 3, page 1 rows 2, 3); interleave 1: 1, 3, 5, 7
    assert [(c.producer_page, c.producer_offset, c.nbytes) for c in good] == [(0, 2, 2), (1, 2, 2)]


def test_the_dcp_oracle_fails_a_plan_that_ignores_the_interleave(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvspec.spec.parallel as parallel

    # Mutant: every DCP rank reads its own rows of page 0, as if the consumer had no DCP (PAR-8).
    monkeypatch.setattr(parallel, "get_dcp_token_position", lambda local_index, **_: local_index)
    kv = [SubBlock(name="kv_heads", extent=2)]
    page = CanonicalPage(tensors=[PageTensor(name="k", sub_blocks=kv, rows=4, element_bytes=2, token_rows=True)])
    with pytest.raises(AssertionError):
        run_dcp_oracle(page, 1, 2, 2, 1)


def test_kvspec_plan_with_producer_pp_and_consumer_dcp() -> None:
    out = io.StringIO()
    argv = ["plan", "gemma-3-1b", "--tokens", "4096", "--producer-tp", "1", "--consumer-tp", "1", "--producer-pp", "2"]
    assert main([*argv, "--json"], out=out) == 0
    plan = json.loads(out.getvalue())
    reads = plan["consumer_ranks"][0]["reads"]
    # 26 layers in two bands of 13: every layer read once, from the stage that holds it (PAR-7).
    assert {r["producer_stage"] for r in reads} == {0, 1}
    assert sum(r["num_layers"] for r in reads) == 26
    out = io.StringIO()
    argv = ["plan", "deepseek-v2-lite", "--tokens", "4096", "--producer-tp", "2", "--consumer-tp", "1"]
    assert main([*argv, "--consumer-dcp", "2", "--dcp-interleave", "4", "--json"], out=out) == 0
    plan = json.loads(out.getvalue())
    assert [(r["rank"], r["dcp_rank"]) for r in plan["consumer_ranks"]] == [(0, 0), (0, 1)]
    assert plan["producer"]["completion_counts"] == [2, 2]  # both DCP ranks notify both producer ranks (PAR-6)
    for rank in plan["consumer_ranks"]:
        (read,) = rank["reads"]
        assert read["producer_rank"] == 0  # the latent is replicated: one elected source (PAR-4)
        assert read["pages"] == 4096 // 16 // 2
        assert {c["producer_page"] for c in read["copies_per_page"]} == {0, 1}


def test_kvspec_plan_refuses_sizes_that_do_not_divide_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "hymba-1.5b", "--tokens", "1024", "--producer-tp", "1", "--consumer-tp", "2"]
    assert main(argv, out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "kvspec plan: ParallelismError: kv_heads.extent: expected a multiple or a divisor of tp_size 2, got 5 (PAR-1)"
    )


# --------------------------------------------------------------------------- PAR-9 the handshake over byte maps


@given(page=pages(), producer_tp=st.sampled_from(SIZES), consumer_tp=st.sampled_from(SIZES))
def test_source_runs_elect_what_elect_source_rank_elects(
    page: CanonicalPage, producer_tp: int, consumer_tp: int
) -> None:
    # The planner elects a range of units at once; unit by unit, the definition must give the same ranks (PAR-4).
    for rank in range(consumer_tp):
        candidates = get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=rank)
        for tensor in page.tensors:
            for block in tensor.sub_blocks:
                start, end = get_owned_units(block, tp_size=consumer_tp, tp_rank=rank)
                runs = par._get_source_runs(block, start, end, candidates, producer_tp=producer_tp)
                by_run = [source for source, first, stop in runs for _ in range(first, stop)]
                kw = {"producer_tp": producer_tp, "consumer_tp": consumer_tp, "consumer_rank": rank}
                assert by_run == [elect_source_rank(block, u, **kw) for u in range(start, end)]


def layout(tp: int, rank: int = 0, page: CanonicalPage | None = None, **kw: Any) -> ParallelLayout:
    return ParallelLayout(rank=RankLayout(tp_size=tp, tp_rank=rank, **kw), pages=[page or kv_page(4)])


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 4), (4, 1), (2, 8), (8, 2), (4, 4), (1, 1)])
def test_layouts_of_tp_pairs_that_divide_compose_for_every_faced_rank(producer_tp: int, consumer_tp: int) -> None:
    for page in (kv_page(4), kv_page(4, order=PageOrder.NHD), mamba2_page(1), mamba2_page(8)):
        for c in range(consumer_tp):
            for p in get_candidate_ranks(producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=c):
                mismatch = get_layout_mismatch(
                    producer=layout(producer_tp, p, page), consumer=layout(consumer_tp, c, page)
                )
                assert mismatch is None, (page, p, c)


OPAQUE = kv_page(4, order=PageOrder.OPAQUE)
# (row, producer layout, consumer layout, the field reported with its rule, both values)
LAYOUT_MISMATCHES: list[tuple[str, ParallelLayout, ParallelLayout, str, tuple[object, object]]] = [
    ("page count", layout(1), attrs.evolve(layout(4), pages=[kv_page(4)] * 2), "pages (PAR-9)", (1, 2)),
    ("extent", layout(1), layout(4, page=kv_page(8)), "pages[0].tensors[0].sub_blocks[0].extent (PAR-9)", (4, 8)),
    (
        "order",
        layout(1),
        layout(4, page=kv_page(4, order=PageOrder.NHD)),
        "pages[0].tensors[0].order (PAR-9)",
        ("hnd", "nhd"),
    ),
    ("sizes that do not divide", layout(2), layout(3), "rank.tp_size (PAR-4)", (2, 3)),
    ("a rank not faced", layout(4, 2), layout(2, 0), "rank.tp_rank (PAR-4)", (2, 0)),
    ("a DCP producer", layout(1, dcp_size=2), layout(4), "rank.dcp_size (PAR-8)", (2, 1)),
    ("no layer in common", layout(1, layers=("a",)), layout(4, layers=("b",)), "rank.layers (PAR-7)", (("a",), ("b",))),
    (
        "heads that do not divide",
        layout(1, page=kv_page(3)),
        layout(4, page=kv_page(3)),
        "pages[0].tensors[0].sub_blocks[0].extent (PAR-1)",
        ("3 at TP 1", "3 at TP 4"),
    ),
    (
        "an opaque page sliced",
        layout(1, page=OPAQUE),
        layout(4, page=OPAQUE),
        "pages[0].tensors[0].order (PAR-5)",
        ("'opaque' at TP 1", "'opaque' at TP 4"),
    ),
]


@pytest.mark.parametrize(
    ("name", "producer", "consumer", "field", "values"), LAYOUT_MISMATCHES, ids=[r[0] for r in LAYOUT_MISMATCHES]
)
def test_layouts_that_do_not_compose_name_the_first_field_and_its_rule(
    name: str, producer: ParallelLayout, consumer: ParallelLayout, field: str, values: tuple[object, object]
) -> None:
    assert get_layout_mismatch(producer=producer, consumer=consumer) == (field, *values)


def test_an_opaque_page_moves_whole_at_equal_tp_and_a_dcp_producer_pairs_with_its_own_layout() -> None:
    assert get_layout_mismatch(producer=layout(4, 1, OPAQUE), consumer=layout(4, 1, OPAQUE)) is None
    assert get_layout_mismatch(producer=layout(2, 1, dcp_size=2), consumer=layout(2, 1, dcp_size=2, dcp_rank=1)) is None


def test_a_planner_that_does_not_tile_is_refused_at_the_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    # Coverage runs on the planner's own copies: a plan that drops one copy leaves a gap (PAR-3).
    right = par.compute_rank_copies
    monkeypatch.setattr(par, "compute_rank_copies", lambda page, **kw: right(page, **kw)[1:])
    field, _, reason = get_layout_mismatch(producer=layout(1), consumer=layout(4, 1)) or ("", "", "")
    assert field == "pages[0].coverage (PAR-3)"
    assert "gap" in str(reason)
