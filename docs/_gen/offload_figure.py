"""The offload figure: one two-group request stored as chunks, and what a later hit loads (OFF-3 ... OFF-7)."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

import kvspec

__all__ = ["offload_example", "offload_svg"]

matplotlib.rcParams["svg.hashsalt"] = "kvspec"

_REAL, _NULL, _CACHED, _CHUNK, _LOADED = "#4c72b0", "#d9d9d9", "#8fd19e", "#dd8452", "#c44e52"
BLOCK, WINDOW, F = 4, 8, 3
STORED_TOKENS, LATER_TOKENS, LOCAL_HIT = 28, 37, 8


def _config() -> kvspec.KVCacheConfig:
    full = kvspec.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float16")
    window = kvspec.SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=WINDOW
    )
    groups = [
        kvspec.KVCacheGroupSpec(layer_names=["full.0"], kv_cache_spec=full),
        kvspec.KVCacheGroupSpec(layer_names=["window.0"], kv_cache_spec=window),
    ]
    page = full.page_size_bytes
    tensors = [
        kvspec.KVCacheTensor(size=64 * page, layers=[g.layer_names[0]], layer_stride=0, block_stride=page)
        for g in groups
    ]
    return kvspec.KVCacheConfig(num_blocks=64, kv_cache_tensors=tensors, kv_cache_groups=groups)


def offload_example() -> dict[str, Any]:
    """Every list of the figure, computed by the reference functions."""
    config = _config()
    offload = kvspec.OffloadConfig(blocks_per_chunk=F, hash_block_size=BLOCK)
    first_ids = [list(range(1 + 10 * g, 1 + 10 * g + STORED_TOKENS // BLOCK)) for g in range(2)]
    store = kvspec.get_store_set(
        config, first_ids, num_offloadable_tokens=STORED_TOKENS, next_chunk=[0, 0], offload=offload
    )
    keys = kvspec.get_offload_keys(config, [bytes([i]) for i in range(LATER_TOKENS // BLOCK)], offload=offload)
    present = [[k in store.complete_chunks[g] for k in range(len(keys[g]))] for g in range(2)]
    hit = kvspec.get_offload_hit_tokens(
        config, present, num_tokens=LATER_TOKENS, local_hit_tokens=LOCAL_HIT, offload=offload
    )
    total = LOCAL_HIT + hit
    later_ids = []
    for g in range(2):
        count = -(-LATER_TOKENS // BLOCK)
        nulls = 0 if g == 0 else max(0, total - WINDOW + 1) // BLOCK  # the window manager's null prefix
        later_ids.append([0] * nulls + list(range(31 + 20 * g + nulls, 31 + 20 * g + count)))
    load = kvspec.get_load_set(config, later_ids, num_tokens=total, local_hit_tokens=LOCAL_HIT, offload=offload)
    return {
        "store": store,
        "present": present,
        "hit": hit,
        "first_ids": first_ids,
        "later_ids": later_ids,
        "load": load,
    }


def _cell(ax: Any, x: float, y: float, text: str, fill: str, *, width: float = 0.9) -> None:
    ax.add_patch(Rectangle((x + 0.05, y), width, 0.6, facecolor=fill, edgecolor="#333333", linewidth=0.6))
    colour = "white" if fill in (_REAL, _LOADED, _CHUNK) else "#333333"
    ax.text(x + 0.05 + width / 2, y + 0.3, text, ha="center", va="center", color=colour, fontsize=7)


def offload_svg() -> bytes:
    """Two panels, one per group: the stored request's blocks, the chunk pool, the later request's load."""
    ex = offload_example()
    store, load = ex["store"], ex["load"]
    names = ["group 0: full attention, B=4", f"group 1: sliding window W={WINDOW}, B=4"]
    width = -(-LATER_TOKENS // BLOCK)
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True)
    for g, ax in enumerate(axes):
        written = {(store.chunks[g][e], s) for e, s in map_entries(store, g)}
        for x, block_id in enumerate(ex["first_ids"][g]):
            _cell(ax, x, 4.0, str(block_id), _REAL)
        for k in range(width // F):
            for s in range(F):
                stored = (k, s) in written
                _cell(ax, k * F + s, 2.0, f"{k}.{s}" if stored else "", _CHUNK if stored else "white")
            ax.add_patch(
                Rectangle((k * F + 0.02, 1.95), F - 0.04, 0.7, fill=False, edgecolor="#333333", linewidth=1.2)
            )
        positions = range(load.first_block_indices[g], load.first_block_indices[g] + load.num_blocks[g])
        for x, block_id in enumerate(ex["later_ids"][g]):
            if block_id == kvspec.NULL_BLOCK_ID:
                fill = _NULL
            elif x < LOCAL_HIT // BLOCK:
                fill = _CACHED
            elif x in positions:
                fill = _LOADED
            else:
                fill = "white"
            _cell(ax, x, 0.0, str(block_id), fill)
        for x, (entry, sub) in zip(positions, load.sub_blocks[g], strict=True):
            source = load.chunks[g][entry] * F + sub
            ax.add_patch(
                FancyArrowPatch(
                    (source + 0.5, 1.95), (x + 0.5, 0.62), arrowstyle="-|>", mutation_scale=8, color=_LOADED
                )
            )
        for y, label in ((4.3, "stored\nrequest"), (2.3, "chunk\npool"), (0.3, "later\nrequest")):
            ax.text(-0.25, y, label, ha="right", va="center", fontsize=7)
        skip = load.first_block_indices[g] % F
        ax.set_title(
            f"{names[g]}: stores chunks {list(store.chunks[g])}; the hit loads chunks {list(load.chunks[g])} "
            f"into blocks {positions.start}-{positions.stop - 1} (skip {skip})",
            loc="left",
            fontsize=8,
        )
        ax.set_xlim(-1.6, width + 0.2)
        ax.set_ylim(-0.3, 4.9)
        ax.set_yticks([])
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xticks([x + 0.5 for x in range(width)])
    axes[-1].set_xticklabels([f"{BLOCK * x}-{BLOCK * x + BLOCK - 1}" for x in range(width)], fontsize=7)
    axes[-1].set_xlabel(
        f"GPU block position (tokens); f={F}: a chunk (framed) holds {F} blocks as sub-blocks k.s; "
        f"later request: N={LATER_TOKENS}, GPU hit {LOCAL_HIT}, offload hit {ex['hit']}"
    )
    colours = (_REAL, _CHUNK, _CACHED, _LOADED, _NULL)
    legend = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#333333") for c in colours]
    fig.legend(
        legend,
        ["GPU block (id)", "stored sub-block", "local GPU hit", "loaded by the hit (OFF-6, OFF-7)", "null block"],
        loc="lower center",
        ncol=5,
        frameon=False,
        bbox_to_anchor=(0.5, -0.05),
    )
    buffer = io.BytesIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return buffer.getvalue()


def map_entries(store: kvspec.StoreSet, g: int) -> tuple[tuple[int, int], ...]:
    """The (chunk entry, sub-block) each source block of group g writes (OFF-7)."""
    return kvspec.map_sub_blocks(
        store.first_block_indices[g], store.num_blocks[g], blocks_per_chunk=store.blocks_per_chunk
    )
