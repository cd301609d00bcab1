"""Small KV-cache configs for scenarios: a few layers, tiny pages, chosen group kinds, block sizes and layouts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from kvspec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

__all__ = ["GroupShape", "chunked", "cross", "full", "gdn", "indexer", "make_config", "mamba", "mla", "sw", "sw_mla"]

ConfigLayout = Literal["separate", "shared", "per_layer", "layers_first"]


@attrs.frozen(kw_only=True)
class GroupShape:
    """One group of a small config: its kind, block size and (for local kinds) window or chunk."""

    kind: Literal["full", "mla", "sw", "sw_mla", "chunked", "indexer", "cross", "mamba"]
    block_size: int = 4
    window: int = 0
    mamba_type: str = "mamba2"
    cache_mode: str = "none"
    num_speculative_blocks: int = 0


def full(block_size: int = 4) -> GroupShape:
    """A full-attention group."""
    return GroupShape(kind="full", block_size=block_size)


def mla(block_size: int = 4) -> GroupShape:
    """An MLA group (full attention for HMA-1)."""
    return GroupShape(kind="mla", block_size=block_size)


def sw(window: int, block_size: int = 4) -> GroupShape:
    """A sliding-window group."""
    return GroupShape(kind="sw", block_size=block_size, window=window)


def sw_mla(window: int, block_size: int = 4) -> GroupShape:
    """A sliding-window MLA group."""
    return GroupShape(kind="sw_mla", block_size=block_size, window=window)


def chunked(chunk: int, block_size: int = 4) -> GroupShape:
    """A chunked-local group (the token at p attends from ``chunk * (p // chunk)``; CACHE-1, WIN-1)."""
    return GroupShape(kind="chunked", block_size=block_size, window=chunk)


def cross(block_size: int = 4) -> GroupShape:
    """An encoder-decoder cross-attention group (refused under HMA, ADM-1)."""
    return GroupShape(kind="cross", block_size=block_size)


def indexer(block_size: int = 4) -> GroupShape:
    """A sparse-attention indexer group: its own page geometry, every position, like MLA (CACHE-1)."""
    return GroupShape(kind="indexer", block_size=block_size)


def mamba(
    block_size: int = 4, *, mamba_type: str = "mamba2", cache_mode: str = "none", num_speculative_blocks: int = 0
) -> GroupShape:
    """A state group (STATE-1 .. STATE-5): Mamba-2 by default; ``mamba_type="gdn_attn"`` for Gated DeltaNet."""
    return GroupShape(
        kind="mamba",
        block_size=block_size,
        mamba_type=mamba_type,
        cache_mode=cache_mode,
        num_speculative_blocks=num_speculative_blocks,
    )


def gdn(block_size: int = 4, *, cache_mode: str = "none", num_speculative_blocks: int = 0) -> GroupShape:
    """A Gated-DeltaNet state group (vLLM's ``GDN_ATTN``), two state tensors (STATE-5)."""
    return mamba(
        block_size, mamba_type="gdn_attn", cache_mode=cache_mode, num_speculative_blocks=num_speculative_blocks
    )


def _spec(shape: GroupShape, padded: int | None) -> AttentionSpec | MambaSpec:
    common = {"block_size": shape.block_size, "page_size_padded": padded}
    attn = {**common, "num_kv_heads": 1, "head_size": 2, "dtype": "int8"}
    if shape.kind == "full":
        return FullAttentionSpec(**attn)  # type: ignore[arg-type]
    if shape.kind == "mla":
        return MLAAttentionSpec(**attn)  # type: ignore[arg-type]
    if shape.kind == "sw":
        return SlidingWindowSpec(**attn, sliding_window=shape.window)  # type: ignore[arg-type]
    if shape.kind == "sw_mla":
        return SlidingWindowMLASpec(**attn, sliding_window=shape.window)  # type: ignore[arg-type]
    if shape.kind == "cross":
        return CrossAttentionSpec(**attn)  # type: ignore[arg-type]
    if shape.kind == "indexer":
        return IndexerSpec(**{**attn, "head_size": 3, "dtype": "uint8"})  # type: ignore[arg-type]
    if shape.kind == "chunked":
        return ChunkedLocalAttentionSpec(**attn, attention_chunk_size=shape.window)  # type: ignore[arg-type]
    # Mamba-2 keeps one small tensor (the suite's historic shape); GDN a conv and a temporal state.
    shapes, dtypes = ([(2, 2)], ["int8"]) if shape.mamba_type != "gdn_attn" else ([(2, 2), (1, 4)], ["int8", "int8"])
    return MambaSpec(
        **common,  # type: ignore[arg-type]
        shapes=shapes,
        dtypes=dtypes,
        mamba_type=shape.mamba_type,
        cache_mode=shape.cache_mode,
        num_speculative_blocks=shape.num_speculative_blocks,
    )


def make_config(
    *groups: GroupShape,
    num_blocks: int = 32,
    layers: int | Sequence[int] = 2,
    layout: ConfigLayout = "separate",
) -> KVCacheConfig:
    """A config with one group per shape; ``layers`` per group (an int, or one count per group).

    - ``separate``: one tensor per group, block-major (the group's layers of a block adjacent).
    - ``layers_first``: one tensor per group, layer-major.
    - ``per_layer``: one tensor per layer.
    - ``shared``: vLLM's hybrid layout: tensor ``i`` holds layer ``i`` of every
      group at the same bytes (pages padded to one size); sound because one
      block id belongs to one group at a time.
    """
    counts = [layers] * len(groups) if isinstance(layers, int) else list(layers)
    natural = [_spec(shape, None).page_size_bytes for shape in groups]
    page = max(natural)
    specs = [
        _spec(shape, page if layout == "shared" and n != page else None)
        for shape, n in zip(groups, natural, strict=True)
    ]
    names = [[f"g{g}.l{i}" for i in range(counts[g])] for g in range(len(groups))]
    group_specs = [
        KVCacheGroupSpec(layer_names=layer_names, kv_cache_spec=spec)
        for layer_names, spec in zip(names, specs, strict=True)
    ]
    tensors: list[KVCacheTensor] = []
    if layout == "shared":
        for i in range(max(counts)):
            tensors.append(
                KVCacheTensor(
                    size=num_blocks * page,
                    layers=[n[i] for n in names if i < len(n)],
                    layer_stride=0,
                    block_stride=page,
                )
            )
    else:
        for layer_names, spec in zip(names, specs, strict=True):
            p = spec.page_size_bytes
            n = len(layer_names)
            if layout == "separate":
                tensors.append(
                    KVCacheTensor(size=num_blocks * n * p, layers=layer_names, layer_stride=p, block_stride=n * p)
                )
            elif layout == "layers_first":
                tensors.append(
                    KVCacheTensor(
                        size=num_blocks * n * p, layers=layer_names, layer_stride=num_blocks * p, block_stride=p
                    )
                )
            else:
                tensors += [
                    KVCacheTensor(size=num_blocks * p, layers=[name], layer_stride=0, block_stride=p)
                    for name in layer_names
                ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=group_specs)
