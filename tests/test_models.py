"""Tests for the typed models: validation names the field, page sizes, layout cross-checks, BlockIds."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec import (
    BlockIds,
    ChunkedLocalAttentionSpec,
    ConfigError,
    CrossAttentionSpec,
    DType,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVSpecError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SpecKind,
)

# --------------------------------------------------------------------------- DType


@pytest.mark.parametrize(
    ("name", "canonical", "itemsize"),
    [
        ("float32", "float32", 4),
        ("float16", "float16", 2),
        ("bfloat16", "bfloat16", 2),
        ("bf16", "bfloat16", 2),
        ("torch.float16", "float16", 2),
        ("fp8", "float8_e4m3fn", 1),
        ("fp8_e5m2", "float8_e5m2", 1),
        ("float8_e4m3fnuz", "float8_e4m3fnuz", 1),
        ("uint8", "uint8", 1),
    ],
)
def test_dtype_names_and_item_sizes(name: str, canonical: str, itemsize: int) -> None:
    dtype = DType.from_name(name)
    assert dtype.name == canonical
    assert dtype.itemsize == itemsize
    assert str(dtype) == canonical
    assert dtype == DType(name=canonical)


@pytest.mark.parametrize("bad", ["float64x", "", 3, None])
def test_dtype_rejects_unknown_names_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"DType\.name"):
        DType(name=bad)


def test_dtype_repr_is_valid_python() -> None:
    dtype = DType.from_name("bf16")
    assert eval(repr(dtype)) == dtype


# --------------------------------------------------------------------------- specs and page sizes

attention = st.fixed_dictionaries(
    {
        "block_size": st.integers(1, 64),
        "num_kv_heads": st.integers(1, 16),
        "head_size": st.integers(1, 256),
        "dtype": st.sampled_from(["float32", "bfloat16", "fp8"]),
    }
)


@given(kw=attention)
def test_attention_page_is_k_and_v(kw: dict[str, object]) -> None:
    spec = FullAttentionSpec(**kw)  # type: ignore[arg-type]
    expected = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
    assert spec.page_size_bytes == expected
    # Every attention kind but MLA stores K and V the same way.
    assert SlidingWindowSpec(**kw, sliding_window=7).page_size_bytes == expected  # type: ignore[arg-type]
    assert ChunkedLocalAttentionSpec(**kw, attention_chunk_size=8).page_size_bytes == expected  # type: ignore[arg-type]
    assert CrossAttentionSpec(**kw).page_size_bytes == expected  # type: ignore[arg-type]


@given(kw=attention)
def test_mla_page_is_a_single_latent(kw: dict[str, object]) -> None:
    spec = MLAAttentionSpec(**kw)  # type: ignore[arg-type]
    assert spec.page_size_bytes == spec.block_size * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
    assert SlidingWindowMLASpec(**kw, sliding_window=3).page_size_bytes == spec.page_size_bytes  # type: ignore[arg-type]


def test_page_size_pins() -> None:
    # Gemma 3 27B: B=16, 16 KV heads, head 128, bf16 -> 2*16*16*128*2 = 131072 bytes per layer per block.
    assert FullAttentionSpec(block_size=16, num_kv_heads=16, head_size=128, dtype="bf16").page_size_bytes == 131072
    # DeepSeek-V2-Lite MLA: 576-wide latent, bf16 -> 16*576*2.
    assert MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bf16").page_size_bytes == 18432
    # Different V head size.
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, head_size_v=4, dtype="float16")
    assert spec.page_size_bytes == 4 * 2 * (8 + 4) * 2


def test_mamba_page_is_summed_state_bytes() -> None:
    spec = MambaSpec(block_size=16, shapes=[(3, 8), (4, 5, 6)], dtypes=["bfloat16", "float32"])
    assert spec.page_size_bytes == 3 * 8 * 2 + 4 * 5 * 6 * 4
    assert spec.kind is SpecKind.MAMBA


def test_padded_page_replaces_the_real_one_and_must_be_at_least_as_large() -> None:
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=2, dtype="float16", page_size_padded=64)
    assert spec.real_page_size_bytes == 8
    assert spec.page_size_bytes == 64
    with pytest.raises(ConfigError, match="page_size_padded"):
        FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=2, dtype="float16", page_size_padded=7)


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 0), ("num_kv_heads", -1), ("head_size", 1.5), ("block_size", True), ("head_size_v", 0)],
)
def test_spec_validation_names_the_field(field: str, value: object) -> None:
    kw: dict[str, object] = {"block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": "bf16", field: value}
    with pytest.raises(ConfigError, match=rf"FullAttentionSpec\.{field}") as info:
        FullAttentionSpec(**kw)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVSpecError)


def test_sliding_window_is_required_and_positive() -> None:
    with pytest.raises(ConfigError, match=r"SlidingWindowSpec\.sliding_window"):
        SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16", sliding_window=0)
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'sliding_window'"):
        SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16")  # type: ignore[call-arg]


def test_mamba_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"MambaSpec\.shapes"):
        MambaSpec(block_size=16, shapes=[], dtypes=[])
    with pytest.raises(ConfigError, match=r"MambaSpec\.dtypes"):
        MambaSpec(block_size=16, shapes=[(1, 2)], dtypes=["bf16", "bf16"])


def test_spec_kinds_and_subclassing() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16")
    swmla = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16", sliding_window=8)
    assert mla.kind is SpecKind.MLA
    assert isinstance(mla, FullAttentionSpec)  # MLA counts as full attention (HMA-1)
    assert swmla.kind is SpecKind.SLIDING_WINDOW_MLA
    assert isinstance(swmla, SlidingWindowSpec)


def test_specs_are_frozen_hashable_and_evolvable() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16")
    with pytest.raises(attrs.exceptions.FrozenInstanceError, match=r"can't set attribute|cannot assign"):
        spec.block_size = 32  # type: ignore[misc]
    assert hash(spec) == hash(FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bfloat16"))
    assert attrs.evolve(spec, block_size=32).page_size_bytes == 2 * spec.page_size_bytes


def test_keyword_only() -> None:
    with pytest.raises(TypeError, match=r"takes 1 positional argument but 5 were given"):
        FullAttentionSpec(16, 1, 8, "bf16")  # type: ignore[arg-type, call-arg]


# --------------------------------------------------------------------------- layout and config cross-checks


def _spec(head_size: int = 2) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=head_size, dtype="uint8")  # page = 2*head_size


def test_page_address_rule() -> None:
    tensor = KVCacheTensor(size=1000, layers=["a", "b"], layer_stride=10, block_stride=100, offset=3)
    assert tensor.page_offset(0, 0) == 3
    assert tensor.page_offset(1, 2) == 3 + 10 + 200
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=_spec(5))],
    )
    assert config.page_offset("b", 3) == (0, 3 + 10 + 300)
    assert config.locate("a").layer_index == 0
    with pytest.raises(ConfigError, match="unknown layer"):
        config.locate("zzz")


def test_tensor_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"KVCacheTensor\.size"):
        KVCacheTensor(size=0, layers=["a"], layer_stride=0, block_stride=1)
    with pytest.raises(ConfigError, match=r"KVCacheTensor\.layers"):
        KVCacheTensor(size=8, layers=["a", "a"], layer_stride=0, block_stride=1)
    with pytest.raises(ConfigError, match=r"KVCacheTensor\.block_stride"):
        KVCacheTensor(size=8, layers=["a"], layer_stride=0, block_stride=0)
    # A bare string is one layer name, not a tuple of characters.
    assert KVCacheTensor(size=8, layers="ab", layer_stride=0, block_stride=1).layers == ("ab",)


def test_config_rejects_a_grouped_layer_without_a_tensor() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_groups\[0\].*'b'"):
        KVCacheConfig(
            num_blocks=2,
            kv_cache_tensors=[KVCacheTensor(size=64, layers=["a"], layer_stride=0, block_stride=4)],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=_spec())],
        )


def test_config_rejects_a_layer_in_two_tensors_or_two_groups() -> None:
    tensor = KVCacheTensor(size=64, layers=["a"], layer_stride=0, block_stride=4)
    with pytest.raises(ConfigError, match="exactly one tensor"):
        KVCacheConfig(
            num_blocks=2,
            kv_cache_tensors=[tensor, tensor],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=_spec())],
        )
    with pytest.raises(ConfigError, match="one group only"):
        KVCacheConfig(
            num_blocks=2,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[
                KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=_spec()),
                KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=_spec()),
            ],
        )


@given(num_blocks=st.integers(1, 20), head_size=st.integers(1, 8), slack=st.integers(-3, 3))
def test_config_checks_every_page_fits(num_blocks: int, head_size: int, slack: int) -> None:
    page = 2 * head_size
    needed = (num_blocks - 1) * page + page
    size = needed + slack
    build = lambda: KVCacheConfig(  # noqa: E731
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=max(size, 1), layers=["a"], layer_stride=0, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=_spec(head_size))],
    )
    if max(size, 1) >= needed:
        assert build().num_groups == 1  # type: ignore[no-untyped-call]
    else:
        with pytest.raises(ConfigError, match=r"kv_cache_tensors\[0\]\.size"):
            build()  # type: ignore[no-untyped-call]


def test_config_needs_tensors_and_groups() -> None:
    with pytest.raises(ConfigError, match="kv_cache_groups"):
        KVCacheConfig(
            num_blocks=1,
            kv_cache_tensors=[KVCacheTensor(size=4, layers=["a"], layer_stride=0, block_stride=4)],
            kv_cache_groups=[],
        )
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])


# --------------------------------------------------------------------------- BlockIds

nested = st.lists(st.lists(st.integers(0, 10**6), max_size=8), max_size=5)


@given(groups=nested)
def test_block_ids_behave_like_a_tuple_of_lists(groups: list[list[int]]) -> None:
    ids = BlockIds(groups)
    assert len(ids) == len(groups)
    assert [list(g) for g in ids] == groups
    for i, group in enumerate(groups):
        assert ids[i] == tuple(group)
    assert ids.to_lists() == groups
    assert BlockIds.from_lists(tuple(groups)) == ids
    assert BlockIds(ids) == ids
    assert ids.num_blocks == sum(len(g) for g in groups)
    assert eval(repr(ids)) == ids  # the repr is valid Python
    assert hash(ids) == hash(BlockIds(groups))


def test_block_ids_zero_groups_and_slices() -> None:
    empty = BlockIds([])
    assert len(empty) == 0
    assert empty.num_blocks == 0
    ids = BlockIds([[1, 2], [3], []])
    assert ids[1:] == ((3,), ())
    assert ids[-1] == ()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([[1, -2]], r"groups\[0\]\[1\]"),
        ([[1], [True]], r"groups\[1\]\[0\]"),
        ([[1.0]], r"groups\[0\]\[0\]"),
        (["12"], r"groups\[0\]"),
        ([5], r"groups\[0\]"),
        ("12", r"BlockIds\.groups"),
        (7, r"BlockIds\.groups"),
    ],
)
def test_block_ids_validation_names_the_position(value: object, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BlockIds(value)


def test_block_ids_are_immutable() -> None:
    ids = BlockIds([[1, 2]])
    with pytest.raises(attrs.exceptions.FrozenInstanceError, match=r"can't set attribute|cannot assign"):
        ids.groups = ()  # type: ignore[misc]
    assert isinstance(ids[0], tuple)
