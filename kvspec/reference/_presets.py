"""KV-cache configs of real models, grouped the way vLLM's hybrid KV-cache manager groups them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import attrs

from kvspec.core._errors import ConfigError
from kvspec.core._models import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    DType,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvspec.spec.parallel import CanonicalPage, PageOrder, SubBlock, get_canonical_page

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
  belongs to one group at a time; a block's slot holds the largest page (one
  page size for every group, but a DSA indexer's smaller page).
"""

_LAYOUTS: tuple[str, ...] = ("blocks_first", "layers_first", "per_layer", "shared")

# vLLM pads the attention block size of a Mamba hybrid to a multiple of this.
_MAMBA_BLOCK_ALIGNMENT = 16


def _layer_name(index: int, spec: KVCacheSpec) -> str:
    # vLLM's attention layer names; linear-attention (Mamba-like) layers have their own module, and a DSA
    # indexer's key cache is the indexer's `k_cache` (DeepseekV32IndexerCache's prefix).
    module = "linear_attn" if isinstance(spec, MambaSpec) else "self_attn.attn"
    if isinstance(spec, IndexerSpec):
        module = "self_attn.indexer.k_cache"
    return f"model.layers.{index}.{module}"


def _to_specs(value: Sequence[KVCacheSpec]) -> tuple[KVCacheSpec, ...]:
    return tuple(value)


def _to_state_blocks(value: Sequence[Sequence[SubBlock]]) -> tuple[tuple[SubBlock, ...], ...]:
    return tuple(tuple(blocks) for blocks in value)


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
    state_blocks: tuple[tuple[SubBlock, ...], ...] = attrs.field(default=(), converter=_to_state_blocks)
    """Per state tensor (conv, then SSM), the sub-blocks of its split axis with their global extents (PAR-2).

    Every state layer of a preset has one kind, so one list serves them all.
    """
    specs_per_layer: int = 1
    """Entries of ``layer_specs`` per decoder layer, for layer names: 2 where each layer keeps two caches (DSA)."""

    @property
    def num_layers(self) -> int:
        """Decoder layers that hold KV cache or state."""
        return len(self.layer_specs)

    def get_canonical_page(self, spec: KVCacheSpec, *, order: PageOrder = PageOrder.HND) -> CanonicalPage:
        """The canonical page of one of this model's group specs, its state sub-blocks included (PAR-2)."""
        blocks = self.state_blocks if isinstance(spec, MambaSpec) else ()
        return get_canonical_page(spec, state_blocks=blocks, order=order)

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
        ``dtype`` overrides the KV dtype (e.g. ``"fp8"``; state tensors keep
        theirs). ``head_size_divisor`` divides every attention head size and
        the largest dimension of every state tensor (floor, at least 1) to
        shrink pages for tests while windows, group structure and, near
        enough, block sizes stay.
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
                layer_names=[_layer_name(i // self.specs_per_layer, specs[i]) for i in indices[:max_layers_per_group]],
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
        if isinstance(spec, IndexerSpec):
            # An indexer row is a packed byte layout (fp8 values and their scales): no KV dtype applies to it.
            out.append(attrs.evolve(spec, block_size=block_size, head_size=max(1, spec.head_size // divisor)))
        elif isinstance(spec, AttentionSpec):
            head_size = max(1, spec.head_size // divisor)
            out.append(attrs.evolve(spec, block_size=block_size, head_size=head_size, dtype=new_dtype or spec.dtype))
        elif isinstance(spec, MambaSpec):
            shapes = [_shrink_largest(shape, divisor) for shape in spec.shapes]
            out.append(attrs.evolve(spec, block_size=block_size, shapes=shapes))
        else:
            out.append(attrs.evolve(spec, block_size=block_size))
    return out


def _shrink_largest(shape: tuple[int, ...], divisor: int) -> tuple[int, ...]:
    # Divide the first largest dimension, so a state page shrinks about as much as an attention page.
    i = shape.index(max(shape))
    return (*shape[:i], max(1, shape[i] // divisor), *shape[i + 1 :])


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
    # vLLM keeps a DSA indexer in its MLA layer's group with that group's block size and its own page size
    # (UniformTypeKVCacheSpecs); kvspec gives it a group of its own (CACHE-1), so it stays out of the unifying.
    largest = max(s.page_size_bytes for s in specs if not isinstance(s, IndexerSpec))
    out: list[KVCacheSpec] = []
    for s in specs:
        if isinstance(s, IndexerSpec):
            out.append(s)
            continue
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
    # Page sizes are unified before this, but for a DSA indexer (its own page size, CACHE-1): a slot holds the
    # largest page and a smaller page fills its start, so the groups still share one block id space.
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
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
    description="36 chunked-local (C=8192) + 12 full-attention layers: 3 chunked-local groups, then 1 FA group; "
    "each chunked-local group keeps 513 blocks, one chunk and one more (SW-1, CACHE-1).",
)

# vLLM's DSA indexer key cache: 128 fp8 values and one fp32 scale per 128 values = 132 bytes a token, one head
# (deepseek_v2.py, Indexer: head_dim + head_dim // quant_block_size * 4, dtype uint8).
_DSA_INDEXER_ROW = 128 + 128 // 128 * 4

_DEEPSEEK_V32 = ModelPreset(
    hf_id="deepseek-ai/DeepSeek-V3.2-Exp",
    alias="deepseek-v3.2",
    source=(
        "https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/config.json (num_hidden_layers 61, "
        "kv_lora_rank 512 + qk_rope_head_dim 64 = one 576-wide latent per token, bfloat16; index_head_dim 128, "
        "index_n_heads 64, index_topk 2048). The indexer's key cache is vLLM's DeepseekV32IndexerCache: "
        "MLAAttentionSpec(num_kv_heads=1, head_size=128 + 128 // 128 * 4 = 132, dtype uint8) per layer "
        "(vllm/model_executor/models/deepseek_v2.py, Indexer). index_topk only selects which positions a query "
        "reads: the cache keeps every position. The MTP layer (num_nextn_predict_layers 1) is left out."
    ),
    layer_specs=[
        spec
        for _ in range(61)
        for spec in (
            MLAAttentionSpec(block_size=_B, num_kv_heads=1, head_size=576, dtype="bfloat16"),
            IndexerSpec(block_size=_B, num_kv_heads=1, head_size=_DSA_INDEXER_ROW, dtype="uint8"),
        )
    ],
    specs_per_layer=2,
    description="61 MLA layers, each with a sparse-attention indexer key cache (132 bytes a token): 1 MLA group, "
    "then 1 indexer group with its own page size; both every position, replicated across ranks (CACHE-1).",
)


# State groups (STATE-1 .. STATE-5). Shapes are vLLM 0.33's ``MambaStateShapeCalculator`` at TP 1 with the conv
# state in DS layout, (conv dim, kernel - 1): the layout vLLM's NIXL path asserts (docs/spec/memory-layout.md); the SD
# layout holds the same bytes transposed. Dtypes are vLLM's defaults for ``mamba_cache_dtype`` /
# ``mamba_ssm_cache_dtype`` "auto" (``MambaStateDtypeCalculator``). No preset has speculative scratch slots
# (``num_speculative_blocks`` 0, no MTP) or prefix caching (cache mode "none"). vLLM pads every state page to
# the attention page (``_unify_page_sizes``), so each state group's page ends in padding that never travels.


def _state(shapes: list[tuple[int, ...]], dtypes: list[str], mamba_type: str) -> MambaSpec:
    return MambaSpec(block_size=_B, shapes=shapes, dtypes=dtypes, mamba_type=mamba_type)


def _gdn_state(k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv_kernel: int) -> MambaSpec:
    # Gated DeltaNet: conv over Q, K and V (2 * k_heads * k_dim + v_heads * v_dim), recurrent (v_heads, v_dim, k_dim).
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return _state([(conv_dim, conv_kernel - 1), (v_heads, v_dim, k_dim)], ["bfloat16", "bfloat16"], "gdn_attention")


def _mamba1_state(inner: int, state: int, conv_kernel: int, dtype: str) -> MambaSpec:
    # Mamba-1: conv state (inner, kernel - 1), SSM state (inner, state).
    return _state([(inner, conv_kernel - 1), (inner, state)], [dtype, dtype], "mamba1")


def _mamba2_state(
    heads: int, head_dim: int, groups: int, state: int, conv_kernel: int, ssm_dtype: str = "bfloat16"
) -> MambaSpec:
    # Mamba-2: conv state (heads * head_dim + 2 * groups * state, kernel - 1), SSM state (heads, head_dim, state).
    conv_dim = heads * head_dim + 2 * groups * state
    return _state([(conv_dim, conv_kernel - 1), (heads, head_dim, state)], ["bfloat16", ssm_dtype], "mamba2")


# The sub-blocks of each state tensor's split axis, from the same config values (PAR-2): the conv state's
# sub-projections in vLLM's channel order (Mamba-2 x, B, C; GDN and KDA Q, K, V), then the SSM state's heads.
# Each is split by TP on its own, so B and C follow n_groups, not the TP ratio of the whole conv dim (#55208).


def _gdn_blocks(k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> list[list[SubBlock]]:
    qkv = [SubBlock(name="q", extent=k_heads, width=k_dim), SubBlock(name="k", extent=k_heads, width=k_dim)]
    return [[*qkv, SubBlock(name="v", extent=v_heads, width=v_dim)], [SubBlock(name="v_heads", extent=v_heads)]]


def _mamba1_blocks(inner: int) -> list[list[SubBlock]]:
    return [[SubBlock(name="x", extent=inner)], [SubBlock(name="inner", extent=inner)]]


def _mamba2_blocks(heads: int, head_dim: int, groups: int, state: int) -> list[list[SubBlock]]:
    x = SubBlock(name="x", extent=heads, width=head_dim)
    b, c = (SubBlock(name=name, extent=groups, width=state) for name in ("B", "C"))
    return [[x, b, c], [SubBlock(name="heads", extent=heads)]]


def _kda_blocks(heads: int, head_dim: int) -> list[list[SubBlock]]:
    qkv = [SubBlock(name=name, extent=heads, width=head_dim) for name in ("q", "k", "v")]
    return [qkv, [SubBlock(name="heads", extent=heads)]]


def _kda_state(heads: int, head_dim: int, conv_kernel: int) -> MambaSpec:
    # Kimi Delta Attention: conv over Q, K and V (3 * heads * head_dim), recurrent (heads, head_dim, head_dim) kept
    # in float32 (vLLM's kda_state_dtype for "auto"). vLLM 0.33 runs KDA through its GDN backend
    # (kimi_gdn_linear_attn.py); kvspec names the kind "kda" because the state differs from GDN's.
    shapes = [(3 * heads * head_dim, conv_kernel - 1), (heads, head_dim, head_dim)]
    return _state(shapes, ["bfloat16", "float32"], "kda")


_QWEN3_NEXT = ModelPreset(
    hf_id="Qwen/Qwen3-Next-80B-A3B-Instruct",
    alias="qwen3-next-80b",
    source=(
        "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (num_hidden_layers 48, "
        "full_attention_interval 4, num_key_value_heads 2, head_dim 256, linear_num_key_heads 16, "
        "linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4, "
        "bfloat16). vLLM pads the attention block size so one page holds the linear-attention state."
    ),
    layer_specs=_every_nth_global(48, 4, _gdn_state(16, 32, 128, 128, 4), _full(2, 256)),
    state_blocks=_gdn_blocks(16, 32, 128, 128),
    description="36 Gated-DeltaNet + 12 full-attention layers: 3 state groups (gdn_attention: conv (8192, 3) and "
    "recurrent (32, 128, 128), bf16), then 1 FA group; B = 544, state pages padded by 16 KiB.",
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
    layer_specs=[_mamba1_state(2 * 768, 16, 4, "float32")] * 24,
    state_blocks=_mamba1_blocks(2 * 768),
    description="24 Mamba-1 layers: one state group with no padding (no attention page to match); "
    "refused by offload (OFF-9).",
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
    layer_specs=[spec for _ in range(36) for spec in (_full(2, 64), _mamba2_state(24, 64, 1, 128, 4))],
    state_blocks=_mamba2_blocks(24, 64, 1, 128),
    description="36 attention + 36 Mamba-2 mixers (one of each per decoder layer; listed as 72 entries): "
    "an attention group and a state group; refused by offload (OFF-9).",
)

# Nemotron-H: M = Mamba-2 layer, * = attention layer, - = MLP layer (holds no cache, left out of the list).
_NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

_NEMOTRON_H_8B = ModelPreset(
    hf_id="nvidia/Nemotron-H-8B-Base-8K",
    alias="nemotron-h-8b",
    source=(
        "https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json (num_hidden_layers 52, "
        f"hybrid_override_pattern {_NEMOTRON_H_8B_PATTERN}, hidden_size 4096, num_attention_heads 32 so head_dim "
        "128, num_key_value_heads 8, mamba_num_heads 128, mamba_head_dim 64, n_groups 8, ssm_state_size 128, "
        "conv_kernel 4, bfloat16). vLLM keeps Nemotron-H's SSM state in float32 unless the config names another "
        "mamba_ssm_cache_dtype (NemotronHForCausalLMConfig in vLLM 0.33's models/config.py)."
    ),
    layer_specs=[
        _full(8, 128) if c == "*" else _mamba2_state(128, 64, 8, 128, 4, ssm_dtype="float32")
        for c in _NEMOTRON_H_8B_PATTERN
        if c != "-"
    ],
    state_blocks=_mamba2_blocks(128, 64, 8, 128),
    description="24 Mamba-2 + 4 attention layers (the 24 MLP layers hold no cache): 6 state groups (conv (10240, 3) "
    "bf16, SSM (128, 64, 128) float32), then 1 FA group; B = 1040.",
)

_JAMBA_MINI = ModelPreset(
    hf_id="ai21labs/AI21-Jamba-Mini-1.5",
    alias="jamba-mini-1.5",
    source=(
        "https://huggingface.co/ai21labs/AI21-Jamba-Mini-1.5/blob/main/config.json (num_hidden_layers 32, "
        "hidden_size 4096, num_attention_heads 32, num_key_value_heads 8, attn_layer_period 8, attn_layer_offset 4, "
        "bfloat16). The Mamba numbers (mamba_d_state 16, mamba_d_conv 4, mamba_expand 2) are those of "
        "ai21labs/Jamba-v0.1's config.json; Jamba 1.5 keeps that architecture (arXiv 2408.12570), an assumption "
        "not checked against the 1.5 file."
    ),
    layer_specs=[_full(8, 128) if i % 8 == 4 else _mamba1_state(2 * 4096, 16, 4, "bfloat16") for i in range(32)],
    state_blocks=_mamba1_blocks(2 * 4096),
    description="28 Mamba-1 + 4 attention layers: 7 state groups (conv (8192, 3), SSM (8192, 16), bf16), "
    "then 1 FA group; B = 80.",
)

_KIMI_LINEAR_FULL = (4, 8, 12, 16, 20, 24, 27)  # 1-based, as the config lists them

_KIMI_LINEAR = ModelPreset(
    hf_id="moonshotai/Kimi-Linear-48B-A3B-Instruct",
    alias="kimi-linear-48b",
    source=(
        "https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json (num_hidden_layers "
        "27, linear_attn_config: full_attn_layers [4, 8, 12, 16, 20, 24, 27] (1-based), the other 20 KDA, num_heads "
        "32, head_dim 128, short_conv_kernel_size 4; MLA kv_lora_rank 512 + qk_rope_head_dim 64 = one 576-wide "
        "latent per token; bfloat16)."
    ),
    layer_specs=[
        MLAAttentionSpec(block_size=_B, num_kv_heads=1, head_size=576, dtype="bfloat16")
        if i + 1 in _KIMI_LINEAR_FULL
        else _kda_state(32, 128, 4)
        for i in range(27)
    ],
    state_blocks=_kda_blocks(32, 128),
    description="20 KDA + 7 MLA layers: 3 state groups (kda: conv (12288, 3) bf16, recurrent (32, 128, 128) "
    "float32), then 1 MLA group; B = 1888.",
)

_HYMBA_GLOBAL = (0, 15, 31)

_HYMBA_15B = ModelPreset(
    hf_id="nvidia/Hymba-1.5B-Base",
    alias="hymba-1.5b",
    source=(
        "https://huggingface.co/nvidia/Hymba-1.5B-Base/blob/main/config.json (num_hidden_layers 32, hidden_size "
        "1600, num_attention_heads 25 so head_dim 64, num_key_value_heads 5, sliding_window 1024, global attention "
        "in layers 0, 15 and 31 (global_attn_idx), bfloat16); every layer runs attention heads and an SSM mixer "
        "side by side. Assumed, not checked against the file: a Mamba-1 mixer with mamba_expand 2, "
        "mamba_d_state 16, mamba_d_conv 4. Simplified: every layer holds its own KV (the model shares KV between "
        "some neighbouring layers, kv_reuse_group), and its 128 meta tokens are ordinary prompt tokens. vLLM 0.33 "
        "does not serve Hymba; the preset is here for state, sliding-window and full attention in one model."
    ),
    layer_specs=[
        spec
        for i in range(32)
        for spec in (
            _full(5, 64) if i in _HYMBA_GLOBAL else _sliding(5, 64, 1024),
            _mamba1_state(2 * 1600, 16, 4, "bfloat16"),
        )
    ],
    state_blocks=_mamba1_blocks(2 * 1600),
    description="32 Mamba-1 mixers + 29 sliding-window (W=1024) + 3 full-attention layers (listed as 64 entries): "
    "1 FA group, 11 state groups, 10 SW groups; B = 96.",
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
    _DEEPSEEK_V32,
    _QWEN3_NEXT,
    _MAMBA_130M,
    _FALCON_H1_05B,
    _NEMOTRON_H_8B,
    _JAMBA_MINI,
    _KIMI_LINEAR,
    _HYMBA_15B,
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
