"""Tests for the model presets: lookup, vLLM grouping, layouts (PLAN-1) and admission of real models."""

from __future__ import annotations

import pytest

from kvspec import (
    ChunkedLocalAttentionSpec,
    ConfigError,
    FullAttentionSpec,
    IndexerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    TokenBasis,
    UnsupportedHybridError,
    check_hybrid_support,
    get_blocks_per_sw,
    get_token_basis_group,
    is_hma_required,
)
from kvspec.presets import ModelPreset, get_preset, list_presets
from kvspec.spec import check_cache_accounting, get_page_byte_ranges

TINY = {"num_blocks": 3, "max_layers_per_group": 2, "head_size_divisor": 64}
LAYOUTS = ["blocks_first", "layers_first", "per_layer", "shared"]


def test_every_preset_is_found_by_hf_id_and_alias() -> None:
    presets = list_presets()
    assert len({p.alias for p in presets}) == len(presets)
    for preset in presets:
        assert get_preset(preset.hf_id) is preset
        assert get_preset(preset.alias) is preset
        assert get_preset(preset.alias.upper()) is preset
        assert preset.source.startswith("https://")


def test_required_presets_exist() -> None:
    for name in [
        "google/gemma-3-27b-it",
        "gemma-3-27b",
        "google/gemma-3-1b-it",
        "gemma-3-1b",
        "openai/gpt-oss-120b",
        "gpt-oss-120b",
        "openai/gpt-oss-20b",
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistralai/Mistral-7B-v0.1",
        "deepseek-ai/DeepSeek-V2-Lite",
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "google/gemma-4-31B-it",
    ]:
        assert isinstance(get_preset(name), ModelPreset)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="gemma-3-27b"):
        get_preset("gpt-5")


@pytest.mark.parametrize("preset", list_presets(), ids=lambda p: p.alias)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_preset_builds_in_every_layout(preset: ModelPreset, layout: str) -> None:
    config = preset.build_config(layout=layout, **TINY)  # type: ignore[arg-type]
    assert config.num_blocks == 3
    layers = [name for group in config.kv_cache_groups for name in group.layer_names]
    assert len(layers) == len(set(layers))
    for name in layers:
        config.locate(name)


def test_gemma3_27b_groups_as_vllm_does() -> None:
    preset = get_preset("gemma-3-27b")
    # 62 layers, every 6th global: 52 SW + 10 FA; group size 10; SW groups first, FA last
    # (docs/spec/memory-layout.md, Presets).
    assert [len(g) for g in preset.get_group_layout()] == [10, 10, 10, 10, 10, 2, 10]
    assert preset.get_group_layout()[-1] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    config = preset.build_config(num_blocks=2, head_size_divisor=128)
    kinds = [type(g.kv_cache_spec) for g in config.kv_cache_groups]
    assert kinds == [SlidingWindowSpec] * 6 + [FullAttentionSpec]
    assert get_blocks_per_sw(config) == (65,) * 6 + (0,)
    assert is_hma_required(config)
    assert get_token_basis_group(config) == TokenBasis(group_index=6, block_size=16)
    check_hybrid_support(config, mode="read")
    check_hybrid_support(config, mode="write")


def test_gemma3_27b_page_size_at_full_size() -> None:
    config = get_preset("gemma-3-27b").build_config(num_blocks=1, max_layers_per_group=1)
    assert {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups} == {2 * 16 * 16 * 128 * 2}


@pytest.mark.parametrize(("alias", "layers"), [("gpt-oss-120b", 18), ("gpt-oss-20b", 12)])
def test_gpt_oss_is_one_sw_and_one_fa_group(alias: str, layers: int) -> None:
    preset = get_preset(alias)
    assert [len(g) for g in preset.get_group_layout()] == [layers, layers]
    config = preset.build_config(num_blocks=2, max_layers_per_group=1)
    assert get_blocks_per_sw(config) == (9, 0)  # W=128, B=16 -> 9 (SW-1)
    assert get_token_basis_group(config) == TokenBasis(group_index=1, block_size=16)


def test_gemma4_full_layers_get_twice_the_block_size() -> None:
    config = get_preset("gemma-4-31b").build_config(num_blocks=2, max_layers_per_group=1, head_size_divisor=64)
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    assert sizes == [16] * 5 + [32]
    assert len({g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}) == 1
    assert get_token_basis_group(config) == TokenBasis(group_index=5, block_size=32)


def test_full_attention_only_models_never_need_hma() -> None:
    for alias in ("llama-3.1-8b", "deepseek-v2-lite"):
        config = get_preset(alias).build_config(**TINY)  # type: ignore[arg-type]
        assert config.num_groups == 1
        assert not is_hma_required(config)
        check_hybrid_support(config, mode="write", read_only_hma=True)


def test_mistral_sliding_window_only_is_hybrid() -> None:
    config = get_preset("mistral-7b").build_config(**TINY)  # type: ignore[arg-type]
    assert is_hma_required(config)
    assert get_blocks_per_sw(config) == (4096 // 16 + 1,)
    assert get_token_basis_group(config) is None


def test_llama4_and_qwen3_next_are_admitted_under_hma() -> None:
    scout = get_preset("llama-4-scout").build_config(**TINY)  # type: ignore[arg-type]
    assert any(isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec) for g in scout.kv_cache_groups)
    check_hybrid_support(scout, mode="read")  # chunked local is admitted since CACHE-1
    check_hybrid_support(scout, mode="read", disable_hybrid_kv_cache_manager=True)
    # Every 4th layer is global (NoPE), the other 36 chunked local, C = 8192: one chunk is 512 blocks of 16,
    # and one more (SW-1).
    layout = get_preset("llama-4-scout").get_group_layout()
    assert [len(g) for g in layout] == [12, 12, 12, 12]
    assert layout[-1] == list(range(3, 48, 4))
    assert get_blocks_per_sw(scout) == (513, 513, 513, 0)
    qwen = get_preset("qwen3-next-80b").build_config(num_blocks=2, max_layers_per_group=1)
    assert any(isinstance(g.kv_cache_spec, MambaSpec) for g in qwen.kv_cache_groups)
    assert len({g.kv_cache_spec.page_size_bytes for g in qwen.kv_cache_groups}) == 1  # padded to one page
    check_hybrid_support(qwen, mode="read")  # GDN state is admitted under HMA (ADM-1, STATE-1 .. STATE-5)
    with pytest.raises(UnsupportedHybridError, match="mamba"):
        check_hybrid_support(qwen, mode="read", disable_hybrid_kv_cache_manager=True)


def test_layouts_follow_the_page_address_rule() -> None:
    preset = get_preset("gpt-oss-20b")
    kw = {"num_blocks": 4, "max_layers_per_group": 3, "head_size_divisor": 64}
    page = preset.build_config(**kw).kv_cache_groups[0].kv_cache_spec.page_size_bytes  # type: ignore[arg-type]
    blocks_first = preset.build_config(layout="blocks_first", **kw)  # type: ignore[arg-type]
    name = blocks_first.kv_cache_groups[0].layer_names[1]
    assert blocks_first.page_offset(name, 2) == (0, 2 * 3 * page + page)
    layers_first = preset.build_config(layout="layers_first", **kw)  # type: ignore[arg-type]
    assert layers_first.page_offset(name, 2) == (0, 4 * page + 2 * page)
    per_layer = preset.build_config(layout="per_layer", **kw)  # type: ignore[arg-type]
    assert per_layer.page_offset(name, 2) == (1, 2 * page)
    shared = preset.build_config(layout="shared", **kw)  # type: ignore[arg-type]
    # vLLM's hybrid layout: the i-th layer of every group shares one tensor at the same bytes.
    sw_layer, fa_layer = (g.layer_names[1] for g in shared.kv_cache_groups)
    assert shared.page_offset(sw_layer, 2) == shared.page_offset(fa_layer, 2) == (1, 2 * page)
    assert len(shared.kv_cache_tensors) == 3


def test_overrides() -> None:
    preset = get_preset("gemma-3-1b")
    base = preset.build_config(num_blocks=2, max_layers_per_group=1)
    fp8 = preset.build_config(num_blocks=2, max_layers_per_group=1, dtype="fp8")
    assert (
        fp8.kv_cache_groups[0].kv_cache_spec.page_size_bytes * 2
        == base.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    )
    small = preset.build_config(num_blocks=2, block_size=4, max_layers_per_group=1)
    assert {g.kv_cache_spec.block_size for g in small.kv_cache_groups} == {4}
    for bad in ({"num_blocks": 0}, {"num_blocks": 2, "layout": "rows"}, {"num_blocks": 2, "max_layers_per_group": 0}):
        with pytest.raises(ConfigError, match=r"ModelPreset\.build_config\."):
            preset.build_config(**bad)


# --------------------------------------------------------------------------- state presets (independent of admission)

# alias -> (state groups, layers per state group, attention kind and layers, state tensor bytes per layer, block size)
STATE_PRESETS = {
    # GDN: conv (2*16*128 + 32*128, 3) and recurrent (32, 128, 128), bf16.
    "qwen3-next-80b": (3, [12] * 3, [(FullAttentionSpec, 12)], [8192 * 3 * 2, 32 * 128 * 128 * 2], 544),
    # Mamba-2: conv (128*64 + 2*8*128, 3) bf16 and SSM (128, 64, 128) float32; 24 M layers, 4 attention layers.
    "nemotron-h-8b": (6, [4] * 6, [(FullAttentionSpec, 4)], [10240 * 3 * 2, 128 * 64 * 128 * 4], 1040),
    # Mamba-1: conv (2*4096, 3) and SSM (2*4096, 16), bf16; attention every 8th layer from layer 4.
    "jamba-mini-1.5": (7, [4] * 7, [(FullAttentionSpec, 4)], [8192 * 3 * 2, 8192 * 16 * 2], 80),
    # KDA: conv (3*32*128, 3) bf16 and recurrent (32, 128, 128) float32; 7 MLA layers.
    "kimi-linear-48b": (3, [7, 7, 6], [(MLAAttentionSpec, 7)], [12288 * 3 * 2, 32 * 128 * 128 * 4], 1888),
    # Mamba-1 in every layer: conv (2*1600, 3) and SSM (2*1600, 16), bf16; 3 global + 29 sliding-window layers.
    "hymba-1.5b": (
        11,
        [3] * 10 + [2],
        [(FullAttentionSpec, 3), *[(SlidingWindowSpec, 3)] * 9, (SlidingWindowSpec, 2)],
        [3200 * 3 * 2, 3200 * 16 * 2],
        96,
    ),
}


@pytest.mark.parametrize("alias", list(STATE_PRESETS))
def test_state_presets_group_pad_and_size_their_state(alias: str) -> None:
    groups_n, state_layers, attention, tensor_bytes, block_size = STATE_PRESETS[alias]
    config = get_preset(alias).build_config(num_blocks=2)
    state = [g for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    others = [g for g in config.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    assert len(state) == groups_n
    assert [len(g.layer_names) for g in state] == state_layers
    assert [(type(g.kv_cache_spec), len(g.layer_names)) for g in others] == attention
    pages = {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}
    assert len(pages) == 1  # one page size: the state page padded to the attention page (vLLM)
    for group in state:
        spec = group.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        assert [n for _, n in get_page_byte_ranges(spec)] == tensor_bytes
        assert spec.conv_layout == "DS"
        assert spec.shapes[0][1] == 3  # DS: (conv dim, kernel - 1)
        assert spec.real_page_size_bytes == sum(tensor_bytes) <= spec.page_size_bytes
        assert spec.block_size == block_size
    # The attention block grew to the smallest multiple of 16 whose page holds the state.
    per_token = others[0].kv_cache_spec.page_size_bytes // block_size
    assert (block_size - 16) * per_token < sum(tensor_bytes) <= block_size * per_token


def test_state_shrinks_with_the_head_size_divisor() -> None:
    full = get_preset("qwen3-next-80b").build_config(num_blocks=2, max_layers_per_group=1)
    small = get_preset("qwen3-next-80b").build_config(num_blocks=2, max_layers_per_group=1, head_size_divisor=32)
    state = small.kv_cache_groups[0].kv_cache_spec
    assert isinstance(state, MambaSpec)
    assert state.shapes == ((8192 // 32, 3), (32, 128 // 32, 128))  # the first largest dimension of each tensor
    assert state.block_size == full.kv_cache_groups[0].kv_cache_spec.block_size == 544
    assert (
        small.kv_cache_groups[0].kv_cache_spec.page_size_bytes * 32
        == full.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    )


def test_deepseek_v32_keeps_its_indexer_in_a_group_of_its_own() -> None:
    # CACHE-1: the DSA indexer key cache (132 bytes a token, uint8, one head) is its own group, with its own
    # page size and the MLA group's block size; both keep every position and are replicated like MLA.
    config = get_preset("deepseek-v3.2").build_config(num_blocks=2)
    mla, index = (g.kv_cache_spec for g in config.kv_cache_groups)
    assert (type(mla), type(index)) == (MLAAttentionSpec, IndexerSpec)
    assert (mla.page_size_bytes, index.page_size_bytes) == (16 * 576 * 2, 16 * 132)
    assert mla.block_size == index.block_size == 16
    assert config.kv_cache_groups[1].layer_names[0] == "model.layers.0.self_attn.indexer.k_cache"
    assert len(config.kv_cache_groups[1].layer_names) == 61
    assert get_blocks_per_sw(config) == (0, 0)
    check_hybrid_support(config, mode="read")
    check_cache_accounting(config)
    page = get_preset("deepseek-v3.2").get_canonical_page(index)
    assert all(block.replicated for tensor in page.tensors for block in tensor.sub_blocks)
