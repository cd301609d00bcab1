"""Which configs the exchange admits: HMA-1, ADM-1, ADM-2."""

from __future__ import annotations

from kvspec.core._errors import ConfigError, UnsupportedHybridError, format_values
from kvspec.core._models import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    TransferMode,
)
from kvspec.spec.state import STATE_KINDS

__all__ = ["check_hybrid_support", "is_full_attention_spec", "is_hma_required"]

HMA_FLAG = "--disable-hybrid-kv-cache-manager"


def is_full_attention_spec(spec: KVCacheSpec) -> bool:
    """True for full attention and MLA, including vLLM's HMA-off form with a window set (HMA-1)."""
    return isinstance(spec, FullAttentionSpec)


def is_hma_required(config: KVCacheConfig, *, disable_hybrid_kv_cache_manager: bool = False) -> bool:
    """True iff the flag is off and some group is not full attention; SW-only counts as hybrid (HMA-1)."""
    if disable_hybrid_kv_cache_manager:
        return False
    return not all(is_full_attention_spec(group.kv_cache_spec) for group in config.kv_cache_groups)


def _describe(g: int, group: KVCacheGroupSpec) -> str:
    layers = format_values(list(group.layer_names))
    return f"group {g} (kind {group.kv_cache_spec.kind.value}, layers {layers})"


def check_hybrid_support(
    config: KVCacheConfig,
    *,
    mode: TransferMode | str,
    read_only_hma: bool = False,
    disable_hybrid_kv_cache_manager: bool = False,
    pipeline_parallel_size: int = 1,
) -> None:
    """Raise :class:`UnsupportedHybridError` unless the exchange admits this config (ADM-1, ADM-2).

    State groups (``MambaSpec``) of kinds mamba1, mamba2, GDN and KDA, in
    cache mode ``none`` or ``align``, are admitted in READ and WRITE, mixed
    with full-attention and sliding-window groups; their rules are STATE-1 ..
    STATE-5. Still refused: a state kind outside those, state with
    ``--disable-hybrid-kv-cache-manager`` (vLLM then has no per-group state
    table) and state under pipeline parallelism (vLLM's NIXL refuses it). With
    HMA required, every other group must be full attention (incl. MLA and
    sparse-attention indexers), sliding window (incl. SW-MLA) or chunked local
    (CACHE-1). ``read_only_hma=True`` is a connector that
    supports HMA only in READ mode (MoRIIO's policy): WRITE with HMA is
    refused (ADM-1, ADM-2).
    """
    try:
        transfer_mode = TransferMode(mode)
    except ValueError:
        raise ConfigError(f"mode: expected one of {[m.value for m in TransferMode]}, got {mode!r}") from None
    if (
        not isinstance(pipeline_parallel_size, int)
        or isinstance(pipeline_parallel_size, bool)
        or pipeline_parallel_size < 1
    ):
        raise ConfigError(f"pipeline_parallel_size: expected a positive int, got {pipeline_parallel_size!r}")
    groups = list(enumerate(config.kv_cache_groups))
    states = [(g, group, spec) for g, group in groups if isinstance(spec := group.kv_cache_spec, MambaSpec)]
    # A state kind whose tensors the exchange does not know fails closed, flag or not (ADM-1).
    unknown = [
        f"{_describe(g, group)}: mamba_type {spec.mamba_type!r}"
        for g, group, spec in states
        if spec.mamba_type not in STATE_KINDS
    ]
    if unknown:
        raise UnsupportedHybridError(
            f"state groups of kinds {sorted(STATE_KINDS)} are exchanged (ADM-1); unsupported: {'; '.join(unknown)}"
        )
    described = "; ".join(_describe(g, group) for g, group, _ in states)
    # Without the hybrid manager a state has no per-group slot table to pair (ADM-1).
    if states and disable_hybrid_kv_cache_manager:
        raise UnsupportedHybridError(
            f"state groups are exchanged only under the hybrid KV-cache manager (ADM-1): {described}. Drop {HMA_FLAG}."
        )
    # vLLM's NIXL connector refuses Mamba under pipeline parallelism: each stage would hold part of the state.
    if states and pipeline_parallel_size > 1:
        raise UnsupportedHybridError(
            f"pipeline_parallel_size: expected 1 with state groups, got {pipeline_parallel_size} (ADM-1): {described}"
        )
    if not is_hma_required(config, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager):
        return
    # Under HMA only kinds whose blocks the window or state rules cover are exchanged; the rest fail closed (ADM-1).
    # Chunked local attention is admitted since CACHE-1: its budget and needed positions stop at a chunk boundary.
    admitted = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)
    refused = [_describe(g, group) for g, group in groups if not isinstance(group.kv_cache_spec, admitted)]
    if refused:
        raise UnsupportedHybridError(
            "under the hybrid KV-cache manager only full-attention (incl. MLA and indexers), sliding-window "
            "(incl. SW-MLA), chunked-local and state (Mamba, GDN, KDA) groups are exchanged (ADM-1); "
            f"unsupported: {'; '.join(refused)}. "
            f"Pass {HMA_FLAG} to run without HMA."
        )
    # A READ-only connector (MoRIIO's policy) refuses WRITE under HMA (ADM-2).
    if read_only_hma and transfer_mode is TransferMode.WRITE:
        raise UnsupportedHybridError(
            "this connector supports hybrid KV-cache groups in READ mode only (ADM-2); "
            f"use READ mode, or pass {HMA_FLAG}."
        )
