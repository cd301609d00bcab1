"""KV-cache configs of real models, grouped the way vLLM's hybrid KV-cache manager groups them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import attrs

from kvspec._errors import ConfigError
from kvspec._models import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    DType,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "Layout",
    "ModelPreset",
    "get_preset",
    "list_presets",
]

Layout = Literal["blocks_first", "layers_first", "per_layer", "shared"]
"""How a preset lays its pages out in memory (PLAN-1).

- ``blocks_first``: one tensor per group, block-major: the pages of all the
  group's layers for one block are adjacent (vLLM's cross-layer blocks).
- ``layers_first``: one tensor per group, layer-major: each layer's pages are
  one contiguous run of ``num_blocks`` pages.
- ``per_layer``: one tensor per layer (vLLM's classic per-layer KV tensors).
- ``shared``: vLLM's hybrid allocation: tensor ``i`` is shared by the ``i``-th
  layer of every group, all at the same bytes. Sound only because one block id
  belongs to one group at a time; needs one page size for every group.
"""

_LAYOUTS: tuple[str, ...] = ("blocks_first", "layers_first", "per_layer", "shared")

# vLLM pads the attention block size of a Mamba hybrid to a multiple of this.
_MAMBA_BLOCK_ALIGNMENT = 16


def _layer_name(index: int, spec: KVCacheSpec) -> str:
    # vLLM's attention layer names; linear-attention (Mamba-like) layers have their own module.
    module = "linear_attn" if isinstance(spec, MambaSpec) else "self_attn.attn"
    return f"model.layers.{index}.{module}"


def _to_specs(value: Sequence[KVCacheSpec]) -> tuple[KVCacheSpec, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ModelPreset:
    """One model's per-layer KV-cache specs, with the public source of its numbers.

    ``layer_specs[i]`` is the spec of decoder layer ``i`` at block size 16 in
    the model's own KV dtype. :meth:`build_config` turns it into a
    :class:`KVCacheConfig` the way vLLM does: page sizes unified, layers of one
    spec split into groups of equal size, groups ordered by first appearance
    (so Gemma 3 gets its sliding-window groups first and full attention last).
    """

    hf_id: str
    alias: str
    source: str
    layer_specs: tuple[KVCacheSpec, ...] = attrs.field(converter=_to_specs)
    description: str = ""

    @property
    def num_layers(self) -> int:
        """Decoder layers that hold KV cache or state."""
        return len(self.layer_specs)

    def get_group_layout(self) -> list[list[int]]:
        """Layer indices of each group, as vLLM groups them."""
        return _group_layers(_unify_page_sizes(list(self.layer_specs), _B))

    def build_config(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        layout: Layout = "blocks_first",
        max_layers_per_group: int | None = None,
        dtype: str | DType | None = None,
        head_size_divisor: int = 1,
    ) -> KVCacheConfig:
        """Build a :class:`KVCacheConfig` with ``num_blocks`` blocks (null block 0 included).

        ``max_layers_per_group`` keeps only the first layers of each group, so
        tests can use a real model's group structure with a few KiB of memory.
        ``dtype`` overrides the KV dtype (e.g. ``"fp8"``). ``head_size_divisor``
        divides every attention head size (floor, at least 1) to shrink pages
        for tests while windows, block sizes and group structure stay.
        """
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"ModelPreset.build_config.num_blocks: expected a positive int, got {num_blocks!r}")
        if layout not in _LAYOUTS:
            raise ConfigError(f"ModelPreset.build_config.layout: expected one of {list(_LAYOUTS)}, got {layout!r}")
        if max_layers_per_group is not None and (
            not isinstance(max_layers_per_group, int) or max_layers_per_group <= 0
        ):
            raise ConfigError(
                f"ModelPreset.build_config.max_layers_per_group: expected a positive int or None, "
                f"got {max_layers_per_group!r}"
            )
        if not isinstance(head_size_divisor, int) or head_size_divisor <= 0:
            raise ConfigError(
                f"ModelPreset.build_config.head_size_divisor: expected a positive int, got {head_size_divisor!r}"
            )
        specs = _retarget(self.layer_specs, block_size, dtype, head_size_divisor)
        specs = _unify_page_sizes(specs, block_size)
        groups = [
            KVCacheGroupSpec(
                layer_names=[_layer_name(i, specs[i]) for i in indices[:max_layers_per_group]],
                kv_cache_spec=specs[indices[0]],
            )
            for indices in _group_layers(specs)
        ]
        tensors = _TENSOR_BUILDERS[layout](groups, num_blocks)
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


# --------------------------------------------------------------------------- grouping (vLLM rules)


def _retarget(
    specs: Sequence[KVCacheSpec], block_size: int, dtype: str | DType | None, divisor: int
) -> list[KVCacheSpec]:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"ModelPreset.build_config.block_size: expected a positive int, got {block_size!r}")
    new_dtype = DType.from_name(dtype) if isinstance(dtype, str) else dtype
    out: list[KVCacheSpec] = []
    for spec in specs:
        if isinstance(spec, AttentionSpec):
            head_size = max(1, spec.head_size // divisor)
            out.append(attrs.evolve(spec, block_size=block_size, head_size=head_size, dtype=new_dtype or spec.dtype))
        else:
            out.append(attrs.evolve(spec, block_size=block_size))
    return out


def _unify_page_sizes(specs: list[KVCacheSpec], block_size: int) -> list[KVCacheSpec]:
    """Give every layer one page size, as vLLM must before it can share tensors.

    Attention-only models scale the block size of the smaller pages up by the
    page ratio (vLLM's ``unify_kv_cache_spec_page_size``; Gemma 4's global
    layers get twice the block size). Mamba hybrids grow the attention block
    size until one attention page holds the Mamba state, rounded up to a
    multiple of 16, then pad the Mamba page to it (docs/spec/memory-layout.md, Presets; vLLM's hybrid
    allocator notes).
    """
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    if mamba and len(mamba) == len(specs):
        # A pure state model (mamba-130m) has one page size already; there is no attention block to grow.
        return list(specs)
    if mamba:
        state = max(s.page_size_bytes for s in mamba)
        attention = [s for s in specs if not isinstance(s, MambaSpec)]
        per_token = max(s.page_size_bytes // s.block_size for s in attention)
        attn_block = math.ceil(math.ceil(state / per_token) / _MAMBA_BLOCK_ALIGNMENT) * _MAMBA_BLOCK_ALIGNMENT
        page = attn_block * per_token
        return [
            attrs.evolve(s, block_size=attn_block, page_size_padded=page)
            if isinstance(s, MambaSpec)
            else attrs.evolve(s, block_size=attn_block)
            for s in specs
        ]
    largest = max(s.page_size_bytes for s in specs)
    out: list[KVCacheSpec] = []
    for s in specs:
        if largest % s.page_size_bytes:
            raise ConfigError(f"ModelPreset: page size {s.page_size_bytes} does not divide {largest}")
        out.append(attrs.evolve(s, block_size=block_size * (largest // s.page_size_bytes)))
    return out


def _group_layers(specs: Sequence[KVCacheSpec]) -> list[list[int]]:
    """Split layers into groups of equal size, one spec per group (vLLM's rule).

    Layers with equal specs form a type; the group size is the smallest type's
    layer count, or the largest's when all counts are within 25% of each other
    (vLLM ``_get_kv_cache_groups_uniform_page_size``). Each type is cut into
    consecutive chunks of that size; types keep their order of first
    appearance, so a model whose layer 0 is sliding-window lists its
    sliding-window groups first.
    """
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(index)
    counts = [len(v) for v in by_spec.values()]
    group_size = max(counts) if max(counts) < min(counts) * 1.25 else min(counts)
    return [layers[i : i + group_size] for layers in by_spec.values() for i in range(0, len(layers), group_size)]


# --------------------------------------------------------------------------- layouts (PLAN-1)


def _blocks_first(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    tensors = []
    for group in groups:
        page, n = group.kv_cache_spec.page_size_bytes, len(group.layer_names)
        tensors.append(
            KVCacheTensor(
                size=num_blocks * n * page, layers=group.layer_names, layer_stride=page, block_stride=n * page
            )
        )
    return tensors


def _layers_first(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    tensors = []
    for group in groups:
        page, n = group.kv_cache_spec.page_size_bytes, len(group.layer_names)
        tensors.append(
            KVCacheTensor(
                size=num_blocks * n * page, layers=group.layer_names, layer_stride=num_blocks * page, block_stride=page
            )
        )
    return tensors


def _per_layer(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    return [
        KVCacheTensor(
            size=num_blocks * g.kv_cache_spec.page_size_bytes,
            layers=[name],
            layer_stride=0,
            block_stride=g.kv_cache_spec.page_size_bytes,
        )
        for g in groups
        for name in g.layer_names
    ]


def _shared(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(pages) != 1:
        raise ConfigError(f"ModelPreset.build_config.layout: 'shared' needs one page size, got {sorted(pages)}")
    page = pages.pop()
    width = max(len(g.layer_names) for g in groups)
    return [
        KVCacheTensor(
            size=num_blocks * page,
            layers=[g.layer_names[i] for g in groups if i < len(g.layer_names)],
            layer_stride=0,
            block_stride=page,
        )
        for i in range(width)
    ]


_TENSOR_BUILDERS: dict[str, Callable[[Sequence[KVCacheGroupSpec], int], list[KVCacheTensor]]] = {
    "blocks_first": _blocks_first,
    "layers_first": _layers_first,
    "per_layer": _per_layer,
    "shared": _shared,
}


# --------------------------------------------------------------------------- the presets

_B = 16  # every preset is stated at block size 16 (vLLM's default)


def _full(heads: int, head_dim: int, dtype: str = "bfloat16") -> FullAttentionSpec:
    return FullAttentionSpec(block_size=_B, num_kv_heads=heads, head_size=head_dim, dtype=dtype)


def _sliding(heads: int, head_dim: int, window: int, dtype: str = "bfloat16") -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=_B, num_kv_heads=heads, head_size=head_dim, dtype=dtype, sliding_window=window)


def _every_nth_global(num_layers: int, n: int, local: KVCacheSpec, glob: KVCacheSpec) -> list[KVCacheSpec]:
    # Layer i is global when (i + 1) % n == 0: Gemma's sliding_window_pattern, Llama 4's NoPE layers.
    return [glob if (i + 1) % n == 0 else local for i in range(num_layers)]


def _alternating(num_layers: int, first: KVCacheSpec, second: KVCacheSpec) -> list[KVCacheSpec]:
    return [first if i % 2 == 0 else second for i in range(num_layers)]


_GEMMA3_27B = ModelPreset(
    hf_id="google/gemma-3-27b-it",
    alias="gemma-3-27b",
    source=(
        "https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json (text_config: num_hidden_layers 62, "
        "num_key_value_heads 16, head_dim 128, sliding_window 1024, sliding_window_pattern 6, bfloat16)"
    ),
    layer_specs=_every_nth_global(62, 6, _sliding(16, 128, 1024), _full(16, 128)),
    description="52 sliding-window (W=1024) + 10 full-attention layers: 6 SW groups (5x10 + 1x2), then 1 FA group.",
)

_GEMMA3_1B = ModelPreset(
    hf_id="google/gemma-3-1b-it",
    alias="gemma-3-1b",
    source=(
        "https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json (num_hidden_layers 26, "
        "num_key_value_heads 1, head_dim 256, sliding_window 512, layer_types 5 sliding : 1 full, bfloat16)"
    ),
    layer_specs=_every_nth_global(26, 6, _sliding(1, 256, 512), _full(1, 256)),
    description="22 sliding-window (W=512) + 4 full-attention layers: 6 SW groups (5x4 + 1x2), then 1 FA group.",
)

_GEMMA4_31B = ModelPreset(
    hf_id="google/gemma-4-31B-it",
    alias="gemma-4-31b",
    source=(
        "https://huggingface.co/google/gemma-4-31B-it/blob/main/config.json (text_config: 60 layers, 5 sliding : 1 "
        "full, sliding_window 1024, num_key_value_heads 16 / head_dim 256 on sliding layers, "
        "num_global_key_value_heads 4 / global_head_dim 512 on full layers, bfloat16); figures cross-checked with "
        "apxml.com/models/gemma-4-31b. The full layers' pages are half as large, so vLLM doubles their block size."
    ),
    layer_specs=_every_nth_global(60, 6, _sliding(16, 256, 1024), _full(4, 512)),
    description="50 sliding-window (W=1024, B=16) + 10 full-attention layers (B=32): 5 SW groups, then 1 FA group.",
)


def _gpt_oss(hf_id: str, alias: str, num_layers: int) -> ModelPreset:
    return ModelPreset(
        hf_id=hf_id,
        alias=alias,
        source=(
            f"https://huggingface.co/{hf_id}/blob/main/config.json (num_hidden_layers {num_layers}, "
            "num_key_value_heads 8, head_dim 64, sliding_window 128, layer_types alternating sliding_attention / "
            "full_attention starting with sliding; attention kept in bfloat16)"
        ),
        layer_specs=_alternating(num_layers, _sliding(8, 64, 128), _full(8, 64)),
        description=f"{num_layers // 2} sliding-window (W=128) + {num_layers // 2} full-attention layers: 2 groups.",
    )


_LLAMA31_8B = ModelPreset(
    hf_id="meta-llama/Llama-3.1-8B-Instruct",
    alias="llama-3.1-8b",
    source=(
        "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json (num_hidden_layers 32, "
        "num_key_value_heads 8, hidden_size 4096 / num_attention_heads 32 = head_dim 128, bfloat16)"
    ),
    layer_specs=[_full(8, 128)] * 32,
    description="32 full-attention layers: one FA group; HMA is never required.",
)

_MISTRAL_7B = ModelPreset(
    hf_id="mistralai/Mistral-7B-v0.1",
    alias="mistral-7b",
    source=(
        "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json (num_hidden_layers 32, "
        "num_key_value_heads 8, head_dim 128, sliding_window 4096, bfloat16)"
    ),
    layer_specs=[_sliding(8, 128, 4096)] * 32,
    description="32 sliding-window layers (W=4096): one SW group, so HMA is required (HMA-1).",
)

_DEEPSEEK_V2_LITE = ModelPreset(
    hf_id="deepseek-ai/DeepSeek-V2-Lite",
    alias="deepseek-v2-lite",
    source=(
        "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (num_hidden_layers 27, "
        "kv_lora_rank 512 + qk_rope_head_dim 64 = one 576-wide latent per token, bfloat16)"
    ),
    layer_specs=[MLAAttentionSpec(block_size=_B, num_kv_heads=1, head_size=576, dtype="bfloat16")] * 27,
    description="27 MLA layers: one MLA group (counts as full attention, HMA-1).",
)

_LLAMA4_SCOUT = ModelPreset(
    hf_id="meta-llama/Llama-4-Scout-17B-16E-Instruct",
    alias="llama-4-scout",
    source=(
        "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json (text_config: "
        "num_hidden_layers 48, num_key_value_heads 8, head_dim 128, attention_chunk_size 8192, every 4th layer "
        "NoPE global attention, bfloat16)"
    ),
    layer_specs=_every_nth_global(
        48,
        4,
        ChunkedLocalAttentionSpec(
            block_size=_B, num_kv_heads=8, head_size=128, dtype="bfloat16", attention_chunk_size=8192
        ),
        _full(8, 128),
    ),
    description="36 chunked-local (C=8192) + 12 full-attention layers: rejected under HMA (ADM-1).",
)


def _qwen3_next_linear() -> MambaSpec:
    # Gated DeltaNet state at TP 1: conv state (kernel - 1, 2 * key_dim + value_dim), then the
    # recurrent state (value heads, key head dim, value head dim).
    key_dim, value_dim = 16 * 128, 32 * 128
    return MambaSpec(
        block_size=_B,
        shapes=[(3, 2 * key_dim + value_dim), (32, 128, 128)],
        dtypes=["bfloat16", "bfloat16"],
        mamba_type="gdn_attention",
    )


_QWEN3_NEXT = ModelPreset(
    hf_id="Qwen/Qwen3-Next-80B-A3B-Instruct",
    alias="qwen3-next-80b",
    source=(
        "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (num_hidden_layers 48, "
        "full_attention_interval 4, num_key_value_heads 2, head_dim 256, linear_num_key_heads 16, "
        "linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4, "
        "bfloat16). vLLM pads the attention block size so one page holds the linear-attention state."
    ),
    layer_specs=_every_nth_global(48, 4, _qwen3_next_linear(), _full(2, 256)),
    description="36 Gated-DeltaNet (Mamba-like state) + 12 full-attention layers: never admitted (ADM-1).",
)


def _mamba1_state(hidden: int, expand: int, state: int, conv_kernel: int, dtype: str) -> MambaSpec:
    # Mamba-1 at TP 1: conv state (kernel - 1, inner), SSM state (inner, state), inner = expand * hidden.
    inner = expand * hidden
    return MambaSpec(
        block_size=_B, shapes=[(conv_kernel - 1, inner), (inner, state)], dtypes=[dtype, dtype], mamba_type="mamba1"
    )


_MAMBA_130M = ModelPreset(
    hf_id="state-spaces/mamba-130m-hf",
    alias="mamba-130m",
    source=(
        "https://huggingface.co/state-spaces/mamba-130m-hf/blob/main/config.json (hidden_size 768, "
        "num_hidden_layers 24, state_size 16, conv_kernel 4, expand 2; the same d_model, n_layer, d_state and "
        "d_conv as state-spaces/mamba-130m). The state dtype is taken as float32, the checkpoint's, an "
        "assumption not checked against the file. One of vLLM's offloading e2e models (research note on offloading)."
    ),
    layer_specs=[_mamba1_state(768, 2, 16, 4, "float32")] * 24,
    description="24 Mamba-1 layers: one state group; refused by the exchange (ADM-1) and by offload (OFF-9).",
)


def _falcon_h1_mamba() -> MambaSpec:
    # Mamba-2 at TP 1: conv state (kernel - 1, heads * head_dim + 2 * groups * state), SSM (heads, head_dim, state).
    heads, head_dim, state, groups = 24, 64, 128, 1
    return MambaSpec(
        block_size=_B,
        shapes=[(3, heads * head_dim + 2 * groups * state), (heads, head_dim, state)],
        dtypes=["bfloat16", "bfloat16"],
        mamba_type="mamba2",
    )


_FALCON_H1_05B = ModelPreset(
    hf_id="tiiuae/Falcon-H1-0.5B-Instruct",
    alias="falcon-h1-0.5b",
    source=(
        "https://huggingface.co/docs/transformers/model_doc/falcon_h1 (H1 0.5B: depth 36, dim 1024, 8 attention "
        "heads, 2 KV heads, 24 Mamba heads, head dims 64 / 64, d_state 128); every layer runs attention and a "
        "Mamba-2 mixer side by side. mamba_n_groups 1 and a conv kernel of 4 are the config defaults, assumed "
        "here, as is bfloat16. vLLM pads the attention block size so one page holds the state, so the two groups "
        "share one block size and offload runs with blocks_per_chunk 1 (research note on offloading)."
    ),
    layer_specs=[spec for _ in range(36) for spec in (_full(2, 64), _falcon_h1_mamba())],
    description="36 attention + 36 Mamba-2 mixers (one of each per decoder layer; listed as 72 entries): "
    "an attention group and a state group; refused by the exchange (ADM-1) and by offload (OFF-9).",
)

_PRESETS: tuple[ModelPreset, ...] = (
    _GEMMA3_27B,
    _GEMMA3_1B,
    _GEMMA4_31B,
    _gpt_oss("openai/gpt-oss-120b", "gpt-oss-120b", 36),
    _gpt_oss("openai/gpt-oss-20b", "gpt-oss-20b", 24),
    _LLAMA31_8B,
    _MISTRAL_7B,
    _DEEPSEEK_V2_LITE,
    _LLAMA4_SCOUT,
    _QWEN3_NEXT,
    _MAMBA_130M,
    _FALCON_H1_05B,
)

_BY_NAME: dict[str, ModelPreset] = {key.lower(): preset for preset in _PRESETS for key in (preset.hf_id, preset.alias)}


def get_preset(name: str) -> ModelPreset:
    """The preset named by Hugging Face repo id or alias (case-insensitive)."""
    try:
        return _BY_NAME[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(p.alias for p in _PRESETS)
        raise ConfigError(f"get_preset: expected one of {known} (or their Hugging Face ids), got {name!r}") from None


def list_presets() -> tuple[ModelPreset, ...]:
    """Every preset, in a stable order."""
    return _PRESETS
