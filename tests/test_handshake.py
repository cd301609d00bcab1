"""Handshake compatibility (HS-1): every mismatch is rejected, naming each differing field with both values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec import (
    ConfigError,
    EngineDescriptor,
    GroupDescriptor,
    IncompatiblePeerError,
    SpecKind,
    StateProfile,
    TransferMode,
    check_compatibility,
)
from kvspec.presets import get_preset
from kvspec.protocol._handshake import GROUP_FIELDS, get_differences
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, ParallelLayout, RankLayout, SubBlock

SW = GroupDescriptor(
    kind=SpecKind.SLIDING_WINDOW,
    block_size=16,
    sliding_window=512,
    dtype="bfloat16",
    num_kv_heads=1,
    head_size=256,
    page_size_bytes=16 * 1 * 512 * 2,
    layer_names=("layers.0", "layers.1"),
)
FA = GroupDescriptor(
    kind=SpecKind.FULL_ATTENTION,
    block_size=16,
    dtype="bfloat16",
    num_kv_heads=1,
    head_size=256,
    page_size_bytes=16 * 1 * 512 * 2,
    layer_names=("layers.5",),
)
PRODUCER = EngineDescriptor(
    engine_id="prefill-0",
    mode=TransferMode.READ,
    hma_enabled=True,
    groups=(SW, FA),
    num_blocks=1000,
    transport_metadata=b"p-agent",
)
CONSUMER = attrs.evolve(PRODUCER, engine_id="decode-0", num_blocks=3000, transport_metadata=b"c-agent")

Edit = Callable[[EngineDescriptor], EngineDescriptor]


def _group(index: int, **changes: Any) -> Edit:
    def edit(d: EngineDescriptor) -> EngineDescriptor:
        groups = list(d.groups)
        groups[index] = attrs.evolve(groups[index], **changes)
        return attrs.evolve(d, groups=tuple(groups))

    return edit


# One row per mismatch the issue lists: (name, edit of the consumer, field reported, (producer, consumer) values).
MISMATCHES: list[tuple[str, Edit, str, tuple[object, object]]] = [
    ("major version", lambda d: attrs.evolve(d, protocol_version=(2, 0)), "protocol_version.major", (1, 2)),
    ("mode", lambda d: attrs.evolve(d, mode=TransferMode.WRITE), "mode", ("read", "write")),
    ("HMA flag", lambda d: attrs.evolve(d, hma_enabled=False), "hma_enabled", (True, False)),
    ("group count", lambda d: attrs.evolve(d, groups=(SW,)), "num_groups", (2, 1)),
    (
        "group order",
        lambda d: attrs.evolve(d, groups=(FA, SW)),
        "groups.order",
        ((("layers.0", "layers.1"), ("layers.5",)), (("layers.5",), ("layers.0", "layers.1"))),
    ),
    ("kind", _group(0, kind=SpecKind.SLIDING_WINDOW_MLA), "groups[0].kind", ("sliding_window", "sliding_window_mla")),
    ("block size", _group(1, block_size=32), "groups[1].block_size", (16, 32)),
    ("window", _group(0, sliding_window=1024), "groups[0].sliding_window", (512, 1024)),
    ("chunk size", _group(1, attention_chunk_size=8192), "groups[1].attention_chunk_size", (None, 8192)),
    ("dtype", _group(1, dtype="float8_e4m3fn"), "groups[1].dtype", ("bfloat16", "float8_e4m3fn")),
    ("heads", _group(0, num_kv_heads=2), "groups[0].num_kv_heads", (1, 2)),
    ("head size", _group(0, head_size=128), "groups[0].head_size", (256, 128)),
    ("page size", _group(1, page_size_bytes=8192), "groups[1].page_size_bytes", (16384, 8192)),
    (
        "layer names",
        _group(0, layer_names=("layers.0", "layers.2")),
        "groups[0].layer_names",
        (("layers.0", "layers.1"), ("layers.0", "layers.2")),
    ),
    ("tp size", lambda d: attrs.evolve(d, tp_size=2), "tp_size", (1, 2)),
    # Protocol 1.2: a state group's layout (STATE-5) and the engines' state profile (STATE-1).
    ("state shapes", _group(1, state_shapes=((3, 4),)), "groups[1].state_shapes", (None, ((3, 4),))),
    ("state dtypes", _group(1, state_dtypes=("bfloat16",)), "groups[1].state_dtypes", (None, ("bfloat16",))),
    ("state kind", _group(1, mamba_type="gdn_attn"), "groups[1].mamba_type", (None, "gdn_attn")),
    ("conv layout", _group(1, conv_layout="SD"), "groups[1].conv_layout", (None, "SD")),
    (
        "state profile",
        lambda d: attrs.evolve(d, state_profile=StateProfile.PREBUILT),
        "state_profile",
        (None, "prebuilt"),
    ),
]


def test_identical_descriptors_are_compatible() -> None:
    assert check_compatibility(producer=PRODUCER, consumer=CONSUMER) is None


def test_engine_id_blocks_metadata_and_minor_version_may_differ() -> None:
    consumer = attrs.evolve(CONSUMER, protocol_version=(1, 7))
    assert get_differences(PRODUCER, consumer) == {}


@pytest.mark.parametrize(
    ("name", "edit", "field", "values"), MISMATCHES, ids=[row[0].replace(" ", "-") for row in MISMATCHES]
)
def test_each_mismatch_is_rejected_naming_the_field(
    name: str, edit: Edit, field: str, values: tuple[object, object]
) -> None:
    with pytest.raises(IncompatiblePeerError, match=r"incompatible peers \(HS-1\): ") as info:
        check_compatibility(producer=PRODUCER, consumer=edit(CONSUMER))
    assert field in info.value.differences, info.value.differences
    assert info.value.differences[field] == values
    assert field in str(info.value)  # the message alone tells an operator what to fix


def test_the_table_covers_every_group_field() -> None:
    covered = {row[2].split(".", 1)[1] for row in MISMATCHES if row[2].startswith("groups[")}
    assert covered == set(GROUP_FIELDS)


def test_every_difference_is_reported_at_once() -> None:
    consumer = CONSUMER
    for _, edit, _, _ in MISMATCHES:
        if edit is not MISMATCHES[3][1] and edit is not MISMATCHES[4][1]:  # group count/order rewrite the groups
            consumer = edit(consumer)
    diffs = get_differences(PRODUCER, consumer)
    expected = {row[2] for i, row in enumerate(MISMATCHES) if i not in (3, 4)}
    assert set(diffs) == expected


@given(st.sampled_from(MISMATCHES), st.booleans())
def test_the_check_is_symmetric_in_what_it_finds(row: tuple[str, Edit, str, object], swap: bool) -> None:
    _, edit, field, _ = row
    producer, consumer = (edit(PRODUCER), CONSUMER) if swap else (PRODUCER, edit(CONSUMER))
    diffs = get_differences(producer, consumer)
    assert field in diffs
    assert set(diffs) == set(get_differences(consumer, producer))


def test_descriptors_from_two_engines_with_the_same_model_agree() -> None:
    preset = get_preset("gpt-oss-20b")
    producer = EngineDescriptor.from_config(
        engine_id="p",
        config=preset.build_config(num_blocks=16, max_layers_per_group=2),
        mode=TransferMode.READ,
        hma_enabled=True,
    )
    consumer = EngineDescriptor.from_config(
        engine_id="c",
        config=preset.build_config(num_blocks=64, max_layers_per_group=2),
        mode=TransferMode.READ,
        hma_enabled=True,
    )
    check_compatibility(producer=producer, consumer=consumer)
    # A different block size on one side (a block-size ratio) is out of v1 and rejected the same way (HS-1).
    other = EngineDescriptor.from_config(
        engine_id="c",
        config=preset.build_config(num_blocks=64, block_size=32, max_layers_per_group=2),
        mode=TransferMode.READ,
        hma_enabled=True,
    )
    with pytest.raises(IncompatiblePeerError, match=r"groups\[0\]\.block_size: producer=16 consumer=32") as info:
        check_compatibility(producer=producer, consumer=other)
    assert {f for f in info.value.differences if f.endswith(".block_size")}


def test_non_descriptors_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"check_compatibility: expected the consumer's EngineDescriptor"):
        check_compatibility(producer=PRODUCER, consumer={"engine_id": "c"})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- protocol 1.3: parallel layouts (PAR-9)


def _kv_page(heads: int, order: PageOrder = PageOrder.HND) -> CanonicalPage:
    heads_block = SubBlock(name="kv_heads", extent=heads)
    return CanonicalPage(
        tensors=[
            PageTensor(name=n, sub_blocks=[heads_block], rows=16, element_bytes=512, order=order, token_rows=True)
            for n in ("k", "v")
        ]
    )


def _ranked(tp: int, rank: int = 0, *, heads: int = 4, order: PageOrder = PageOrder.HND) -> EngineDescriptor:
    # One rank of an engine with ``heads`` KV heads in all: its groups hold its share, its layout the whole page.
    share = max(1, heads // tp)
    groups = tuple(attrs.evolve(g, num_kv_heads=share, page_size_bytes=16 * share * 1024) for g in PRODUCER.groups)
    layout = ParallelLayout(rank=RankLayout(tp_size=tp, tp_rank=rank), pages=[_kv_page(heads, order)] * len(groups))
    return attrs.evolve(PRODUCER, groups=groups, tp_size=tp, parallel=layout)


def test_a_tp1_producer_and_every_tp4_consumer_rank_are_admitted() -> None:
    # Before protocol 1.3 this pair was refused: "tp_size: producer=1 consumer=4".
    for rank in range(4):
        assert get_differences(_ranked(1), _ranked(4, rank)) == {}
    for rank in range(4):
        assert get_differences(_ranked(4, rank), _ranked(1)) == {}


def test_a_peer_without_a_layout_pairs_with_equal_tp_only_as_in_1_2() -> None:
    legacy = attrs.evolve(_ranked(1), parallel=None)
    assert get_differences(legacy, _ranked(1)) == {}
    assert get_differences(legacy, _ranked(4, 1))["tp_size"] == (1, 4)
    assert get_differences(_ranked(4, 1), attrs.evolve(_ranked(1), parallel=None))["tp_size"] == (4, 1)


def test_with_equal_tp_the_layouts_change_nothing() -> None:
    # Every mismatch of the table is reported the same with both layouts present (the per-rank fields included).
    layout = ParallelLayout(rank=RankLayout(), pages=[_kv_page(1)] * len(PRODUCER.groups))
    for _, edit, field, _ in MISMATCHES:
        if field in ("tp_size", "num_groups"):
            continue  # another TP size, or another group count, and the layout no longer describes the engine
        plain = get_differences(PRODUCER, edit(CONSUMER))
        producer, consumer = attrs.evolve(PRODUCER, parallel=layout), edit(attrs.evolve(CONSUMER, parallel=layout))
        assert get_differences(producer, consumer) == plain


@pytest.mark.parametrize(
    ("producer", "consumer", "field", "values"),
    [
        (
            _ranked(1, heads=3),
            _ranked(4, 1, heads=3),
            "parallel.pages[0].tensors[0].sub_blocks[0].extent (PAR-1)",
            ("3 at TP 1", "3 at TP 4"),
        ),
        (_ranked(2), _ranked(3, 1, heads=6), "parallel.pages[0].tensors[0].sub_blocks[0].extent (PAR-9)", (4, 6)),
        (_ranked(2, heads=6), _ranked(3, 1, heads=6), "parallel.rank.tp_size (PAR-4)", (2, 3)),
        (
            _ranked(1, order=PageOrder.OPAQUE),
            _ranked(4, 2, order=PageOrder.OPAQUE),
            "parallel.pages[0].tensors[0].order (PAR-5)",
            ("'opaque' at TP 1", "'opaque' at TP 4"),
        ),
        (_ranked(4, 3), _ranked(2, 0), "parallel.rank.tp_rank (PAR-4)", (3, 0)),
    ],
    ids=["heads-do-not-divide", "extents-differ", "tp-sizes-do-not-divide", "opaque-page", "rank-not-faced"],
)
def test_layouts_that_do_not_compose_are_refused_naming_the_field_and_rule(
    producer: EngineDescriptor, consumer: EngineDescriptor, field: str, values: tuple[object, object]
) -> None:
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatibility(producer=producer, consumer=consumer)
    assert info.value.differences == {field: values}
    assert field in str(info.value)


def test_with_unequal_tp_a_shared_group_field_is_still_compared() -> None:
    consumer = _ranked(4, 1)
    consumer = attrs.evolve(consumer, groups=(attrs.evolve(consumer.groups[0], block_size=32), consumer.groups[1]))
    assert get_differences(_ranked(1), consumer) == {"groups[0].block_size": (16, 32)}
