"""Which groups the offload tier admits, and how many tokens it can supply: OFF-9, OFF-5."""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.core._errors import ConfigError, GroupCountError, UnsupportedHybridError
from kvspec.core._models import FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from kvspec.spec.coverage import get_needed_token_range

__all__ = ["check_offload_support", "get_offload_hit_tokens"]


def check_offload_support(config: KVCacheConfig, *, blocks_per_chunk: int = 1) -> None:
    """Raise :class:`UnsupportedHybridError` unless every group is attention or an aligned state group (OFF-9).

    Full attention includes MLA; sliding window includes SW-MLA. A state group
    (Mamba, GDN, KDA: a ``MambaSpec``) is admitted in ``align`` cache mode with
    one GPU block per chunk: then chunk ``k`` is the state slot that holds the
    state after exactly ``(k + 1) * C_g`` tokens (STATE-4), so a hit can say
    which state it restores. In ``none`` mode no state is kept at any chunk
    end, and with ``blocks_per_chunk > 1`` a chunk holds one state and
    ``f - 1`` null slots (decisions 161, 162 in decisions-offload.md). Chunked-local attention, cross
    attention and unknown kinds fail closed too, naming the group, its kind and
    the remedy. (OFF-9)
    """
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        # A state group stands at chunk ends only in align mode, one slot per chunk (OFF-9, decision 161 in
        # decisions-offload.md).
        if isinstance(spec, MambaSpec):
            if spec.cache_mode != "align":
                raise UnsupportedHybridError(
                    f"offload: group {g} (kind mamba, {spec.mamba_type}) has cache_mode={spec.cache_mode!r}; expected "
                    "'align' (OFF-9): without prefix caching no state is kept at a chunk end, so no hit can say which "
                    "state it restores; remedy: enable prefix caching (mamba cache mode align)"
                )
            if blocks_per_chunk != 1:
                raise UnsupportedHybridError(
                    f"offload: group {g} (kind mamba, {spec.mamba_type}) with blocks_per_chunk={blocks_per_chunk}; "
                    "expected 1 (OFF-9): a state chunk is one state slot; remedy: leave blocks_per_chunk at 1"
                )
            continue
        # Only kinds whose chunks are a function of token positions are specified (OFF-9).
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise UnsupportedHybridError(
                f"offload: group {g} (kind {spec.kind.value}, layers {list(group.layer_names)[:4]}) is not admitted "
                "(OFF-9): only full-attention (incl. MLA), sliding-window (incl. SW-MLA) and align-mode state groups "
                "are specified; remedy: disable the offloading connector for this model"
            )


def _check_tokens(config: KVCacheConfig, num_tokens: int, local_hit_tokens: int) -> None:
    where = "get_offload_hit_tokens"
    for name, value in (("num_tokens", num_tokens), ("local_hit_tokens", local_hit_tokens)):
        # Token counts index chunks: a negative or non-int count would index from the end (OFF-5).
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}.{name}: expected a non-negative int, got {value!r}")
    # The local hit is part of the request (OFF-5).
    if local_hit_tokens > num_tokens:
        raise ConfigError(f"{where}.local_hit_tokens: expected at most num_tokens={num_tokens}, got {local_hit_tokens}")
    for g, group in enumerate(config.kv_cache_groups):
        # The GPU caches whole blocks, so its hit ends on every group's block boundary (OFF-5).
        if local_hit_tokens % group.kv_cache_spec.block_size:
            raise ConfigError(
                f"{where}.local_hit_tokens: expected a multiple of group {g}'s block size "
                f"{group.kv_cache_spec.block_size}, got {local_hit_tokens}"
            )


def get_offload_hit_tokens(
    config: KVCacheConfig,
    present: Sequence[Sequence[bool]],
    *,
    num_tokens: int,
    local_hit_tokens: int,
    chunk_sizes: Sequence[int],
) -> int:
    """Tokens past the local hit ``C`` the tier can supply for a request of ``num_tokens`` (``N``) (OFF-5).

    ``present[g][k]`` says whether chunk ``k`` of group ``g`` is stored whole
    (OFF-4); ``chunk_sizes[g]`` is ``C_g`` (OFF-1, ``get_chunk_sizes``). The
    hit ends at the largest ``M`` with ``M <= N`` (``N - 1`` when a window
    group exists: the last token is recomputed) and ``M <= len(present[g]) *
    C_g`` such that every position each group needs for the token at ``M``
    (WIN-1's ranges with ``H = C``, ``T = M``) lies in a present chunk. The
    hit is 0 when any group would load less than one chunk. A state group
    (OFF-9) forces ``N - 1`` as a window does, and supports ``M`` only when
    ``M`` is a multiple of ``C_g`` and chunk ``M / C_g - 1`` is present: that
    chunk is the state after exactly ``M`` tokens, so the recomputed tokens
    are never applied twice (vLLM #44599, #51094) (OFF-5).
    """
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    # One GPU block per chunk in a state group: its chunk size is its block size (OFF-9).
    blocks_per_chunk = max(
        [
            size // spec.block_size
            for spec, size in zip(specs, chunk_sizes, strict=False)
            if isinstance(spec, MambaSpec)
        ],
        default=1,
    )
    check_offload_support(config, blocks_per_chunk=blocks_per_chunk)
    # One list of present chunks per group (OFF-5).
    if len(present) != config.num_groups:
        raise GroupCountError(
            f"get_offload_hit_tokens.present: expected {config.num_groups} groups (one per KV-cache group), "
            f"got {len(present)}"
        )
    _check_tokens(config, num_tokens, local_hit_tokens)
    for g, (keys, size) in enumerate(zip(present, chunk_sizes, strict=True)):
        # Only complete chunks have keys (OFF-2).
        if len(keys) > num_tokens // size:
            raise ConfigError(
                f"get_offload_hit_tokens.present[{g}]: expected at most {num_tokens // size} keys (complete chunks of "
                f"{num_tokens} tokens), got {len(keys)}"
            )
    has_window = any(isinstance(spec, (SlidingWindowSpec, MambaSpec)) for spec in specs)
    last = num_tokens - 1 if has_window else num_tokens  # a window or state group recomputes the last token (OFF-5)
    last = min([last, *(len(keys) * size for keys, size in zip(present, chunk_sizes, strict=True))])
    for end in range(last, local_hit_tokens, -1):
        # Less than one chunk to load in some group: no hit (OFF-5).
        if any(end - local_hit_tokens < size for size in chunk_sizes):
            return 0
        # The token at `end` reads WIN-1's positions of every group; each must lie in a present chunk (OFF-5).
        needed = [get_needed_token_range(spec, num_tokens=end, prefix_hit_tokens=local_hit_tokens) for spec in specs]
        states = [g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
        # A state group restores the one chunk whose state absorbed exactly `end` tokens (OFF-5).
        if any(end % chunk_sizes[g] or not present[g][end // chunk_sizes[g] - 1] for g in states):
            continue
        if all(present[g][t // chunk_sizes[g]] for g in range(len(specs)) if g not in states for t in needed[g]):
            return end - local_hit_tokens
    return 0
