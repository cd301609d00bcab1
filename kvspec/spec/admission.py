"""Which configs the exchange admits: HMA-1, ADM-1, ADM-2."""

from __future__ import annotations

from kvspec._errors import ConfigError, UnsupportedHybridError, format_values
from kvspec._models import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    TransferMode,
)

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
) -> None:
    """Raise :class:`UnsupportedHybridError` unless the exchange admits this config (ADM-1, ADM-2).

    Mamba / linear-attention state is refused with or without the flag. With
    HMA required, every group must be full attention (incl. MLA) or sliding
    window (incl. SW-MLA). ``read_only_hma=True`` is a connector that supports
    HMA only in READ mode (MoRIIO's policy): WRITE with HMA is refused (ADM-1, ADM-2).
    """
    try:
        transfer_mode = TransferMode(mode)
    except ValueError:
        raise ConfigError(f"mode: expected one of {[m.value for m in TransferMode]}, got {mode!r}") from None
    groups = list(enumerate(config.kv_cache_groups))
    # State pages are not a function of token positions: no pairing rule applies, flag or not (ADM-1).
    mamba = [_describe(g, group) for g, group in groups if isinstance(group.kv_cache_spec, MambaSpec)]
    if mamba:
        raise UnsupportedHybridError(
            f"Mamba / linear-attention state is not exchanged in v1, with or without {HMA_FLAG} (ADM-1): "
            f"{'; '.join(mamba)}. Serve this model without disaggregated prefill."
        )
    if not is_hma_required(config, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager):
        return
    # Under HMA only kinds whose blocks the window rules cover are exchanged; the rest fail closed (ADM-1).
    admitted = (FullAttentionSpec, SlidingWindowSpec)
    refused = [_describe(g, group) for g, group in groups if not isinstance(group.kv_cache_spec, admitted)]
    if refused:
        raise UnsupportedHybridError(
            "under the hybrid KV-cache manager only full-attention (incl. MLA) and sliding-window (incl. SW-MLA) "
            f"groups are exchanged (ADM-1); unsupported: {'; '.join(refused)}. "
            f"Pass {HMA_FLAG} to run without HMA."
        )
    # A READ-only connector (MoRIIO's policy) refuses WRITE under HMA (ADM-2).
    if read_only_hma and transfer_mode is TransferMode.WRITE:
        raise UnsupportedHybridError(
            "this connector supports hybrid KV-cache groups in READ mode only (ADM-2); "
            f"use READ mode, or pass {HMA_FLAG}."
        )
