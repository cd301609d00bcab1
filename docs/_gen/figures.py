"""Figures for the docs, computed by kvspec's reference functions and planner, drawn with matplotlib."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import FuncFormatter

import kvspec
from kvspec.protocol._summary import blocks_needed_for, summarize_plan

__all__ = [
    "BYTES_MODELS",
    "BYTES_TOKENS",
    "bytes_rows",
    "bytes_svg",
    "clipping_example",
    "clipping_svg",
    "engine_bench_svg",
]

# Stable output: the same SVG bytes on every build.
matplotlib.rcParams["svg.hashsalt"] = "kvspec"
matplotlib.rcParams["font.size"] = 9

BYTES_MODELS = ("gemma-3-27b", "gpt-oss-120b")
BYTES_TOKENS = tuple(2**k for k in range(9, 18))  # 512 .. 131072 tokens

_REAL, _NULL, _CLIPPED, _CACHED = "#4c72b0", "#d9d9d9", "#c6d4ea", "#8fd19e"


def _save(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return buffer.getvalue()


# --------------------------------------------------------------------------- clipping and alignment


def _example_config() -> kvspec.KVCacheConfig:
    """Full attention plus a 32-token sliding window, block size 16 (MoRIIO's two-group test shape)."""
    full = kvspec.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    window = kvspec.SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=32)
    groups = [
        kvspec.KVCacheGroupSpec(layer_names=["full.0"], kv_cache_spec=full),
        kvspec.KVCacheGroupSpec(layer_names=["sliding.0"], kv_cache_spec=window),
    ]
    page = groups[0].kv_cache_spec.page_size_bytes
    tensors = [
        kvspec.KVCacheTensor(size=64 * page, layers=[g.layer_names[0]], layer_stride=0, block_stride=page)
        for g in groups
    ]
    return kvspec.KVCacheConfig(num_blocks=64, kv_cache_tensors=tensors, kv_cache_groups=groups)


def clipping_example(num_tokens: int = 100, prefix_hit_tokens: int = 32) -> dict[str, Any]:
    """Every list of the two-group example, computed by the reference functions."""
    config = _example_config()
    totals = [kvspec.get_logical_block_count(g.kv_cache_spec, num_tokens=num_tokens) for g in config.kv_cache_groups]
    # P's block table after prefill: fresh ids per group.
    table = kvspec.BlockIds([range(1 + 10 * g, 1 + 10 * g + n) for g, n in enumerate(totals)])
    budgets = kvspec.get_blocks_per_sw(config)
    advertised = kvspec.get_exchange_clipped_blocks(table, budgets)  # CLIP-1 on P
    counts = kvspec.get_consumer_block_counts(config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
    offered = kvspec.BlockIds([range(31 + 10 * g, 31 + 10 * g + n) for g, n in enumerate(counts)])
    pairs = kvspec.compute_transfer_pairs(
        config,
        kvspec.TransferRequest(
            num_tokens=num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            producer_block_ids=advertised,
            consumer_block_ids=offered,
        ),
    )
    return {
        "config": config,
        "num_tokens": num_tokens,
        "prefix_hit_tokens": prefix_hit_tokens,
        "totals": totals,
        "table": table,
        "budgets": budgets,
        "advertised": advertised,
        "offered": offered,
        "pairs": pairs,
    }


def _row(ax: Any, y: float, first: int, ids: tuple[int, ...], colour: str, *, faded: tuple[int, ...] = ()) -> None:
    for i, block_id in enumerate(ids):
        x = first + i
        fill = _NULL if block_id == kvspec.NULL_BLOCK_ID else (_CLIPPED if x in faded else colour)
        ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.6, facecolor=fill, edgecolor="#333333", linewidth=0.6))
        text_colour = "white" if fill == _REAL else "#333333"
        ax.text(x + 0.5, y + 0.3, str(block_id), ha="center", va="center", color=text_colour)


def clipping_svg() -> bytes:
    """Two panels, one per group: P's table, what P advertises after clipping, what C offers, and the pairs."""
    ex = clipping_example()
    config, pairs = ex["config"], ex["pairs"]
    names = ["group 0: full attention", "group 1: sliding window W=32"]
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True)
    for g, ax in enumerate(axes):
        total = ex["totals"][g]
        table, advertised, offered = ex["table"][g], ex["advertised"][g], ex["offered"][g]
        hit = ex["prefix_hit_tokens"] // config.kv_cache_groups[g].kv_cache_spec.block_size
        clipped_away = tuple(range(total - len(table), total - len(advertised)))
        _row(ax, 2.2, total - len(table), table, _REAL, faded=clipped_away)
        _row(ax, 0.0, total - len(offered), offered, _REAL)
        for x in range(hit):
            ax.add_patch(Rectangle((x + 0.05, 0.0), 0.9, 0.6, facecolor=_CACHED, edgecolor="#333333", linewidth=0.6))
            ax.text(x + 0.5, 0.3, "hit", ha="center", va="center", color="#333333")
        position = {block_id: total - len(table) + i for i, block_id in enumerate(table)}
        consumer_position = {block_id: total - len(offered) + i for i, block_id in enumerate(offered)}
        for p_id, c_id in zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True):
            ax.add_patch(
                FancyArrowPatch(
                    (position[p_id] + 0.5, 2.2),
                    (consumer_position[c_id] + 0.5, 0.62),
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color="#c44e52",
                    linewidth=0.8,
                )
            )
        ax.text(-0.2, 2.5, "P", ha="right", va="center", fontweight="bold")
        ax.text(-0.2, 0.3, "C", ha="right", va="center", fontweight="bold")
        budget = ex["budgets"][g]
        note = f"budget {budget} (SW-1): P keeps its last {budget}" if budget else "no budget: unchanged by CLIP-1"
        ax.set_title(f"{names[g]} — {note}", loc="left", fontsize=9)
        ax.set_xlim(-0.8, max(ex["totals"]) + 0.2)
        ax.set_ylim(-0.3, 3.1)
        ax.set_yticks([])
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xticks([x + 0.5 for x in range(max(ex["totals"]))])
    axes[-1].set_xticklabels([f"{16 * x}-{16 * x + 15}" for x in range(max(ex["totals"]))], fontsize=7)
    axes[-1].set_xlabel(
        f"logical block (token positions); T = {ex['num_tokens']} tokens, C's prefix hit H = {ex['prefix_hit_tokens']}"
    )
    legend = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#333333") for c in (_REAL, _CLIPPED, _CACHED)]
    fig.legend(
        legend,
        ["real block (id)", "clipped away by P (CLIP-1)", "prefix hit, cached on C"],
        loc="lower center",
        ncol=3,
        frameon=False,
        bbox_to_anchor=(0.5, -0.04),
    )
    return _save(fig)


# --------------------------------------------------------------------------- bytes against context length


def bytes_rows() -> list[tuple[str, int, int, int]]:
    """``(model, tokens, bytes unclipped, bytes clipped)`` for each preset and context length (CLIP-1, PLAN-1).

    Every layer of a group moves the same pairs with the same page size, so the
    plan runs on one layer per group and each group's bytes are scaled by its
    real layer count: the same numbers, a fraction of the build time.
    """
    rows = []
    for name in BYTES_MODELS:
        preset = kvspec.presets.get_preset(name)
        sizing = preset.build_config(num_blocks=2)
        layers = [len(group.layer_names) for group in sizing.kv_cache_groups]
        for tokens in BYTES_TOKENS:
            config = preset.build_config(
                num_blocks=blocks_needed_for(sizing, num_tokens=tokens), max_layers_per_group=1
            )
            groups = summarize_plan(config, num_tokens=tokens).groups
            unclipped = sum(g.blocks_unclipped * g.bytes_per_page * n for g, n in zip(groups, layers, strict=True))
            clipped = sum(g.blocks_clipped * g.bytes_per_page * n for g, n in zip(groups, layers, strict=True))
            rows.append((preset.hf_id, tokens, unclipped, clipped))
    return rows


def bytes_svg(rows: list[tuple[str, int, int, int]]) -> bytes:
    """Log-log plot of bytes moved per request, with and without clipping."""
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    colours = ["#4c72b0", "#dd8452"]
    for colour, model in zip(colours, dict.fromkeys(r[0] for r in rows), strict=False):
        mine = [r for r in rows if r[0] == model]
        tokens = [r[1] for r in mine]
        ax.plot(tokens, [r[2] / 2**30 for r in mine], "--", color=colour, marker="o", ms=3, label=f"{model}, unclipped")
        ax.plot(tokens, [r[3] / 2**30 for r in mine], "-", color=colour, marker="o", ms=3, label=f"{model}, clipped")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("context length T (tokens), no prefix hit")
    ax.set_ylabel("bytes moved per request (GiB)")
    ax.grid(True, which="major", linewidth=0.4, alpha=0.6)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title("KV bytes P hands to C, bf16, block size 16 (kvspec plan)", loc="left", fontsize=9)
    return _save(fig)


# --------------------------------------------------------------------------- what an engine pays (bench_engine.py)


def engine_bench_svg(data: dict[str, Any]) -> bytes:
    """Per-request time against context length, kvspec and vLLM 0.33, from benchmarks/bench_engine.py's JSON."""
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(9.0, 4.0), sharey=True, squeeze=False)
    series = [
        ("reference_us", 1e-3, "-", "#4c72b0", "kvspec: clip both + coverage + pairs"),
        ("plan_ms", 1.0, "-", "#dd8452", "kvspec: plan_transfer, all layers"),
        ("descriptors_ms", 1.0, "-", "#8c8c8c", "kvspec: to_descriptors"),
        ("vllm_clip_pair_us", 1e-3, "--", "#4c72b0", "vLLM 0.33: clip (MoRI-IO) + pairing (NIXL)"),
        ("vllm_desc_ids_ms", 1.0, "--", "#dd8452", "vLLM 0.33: NIXL descriptor ids"),
    ]
    for ax, model in zip(axes[0], models, strict=True):
        for allocation, marker in (("contiguous", "o"), ("shuffled", "s")):
            mine = [r for r in rows if r["model"] == model and r["allocation"] == allocation]
            tokens = [r["tokens"] for r in mine]
            for key, scale, style, colour, label in series:
                if not all(key in r for r in mine):
                    continue
                ax.plot(
                    tokens,
                    [r[key] * scale for r in mine],
                    style,
                    color=colour,
                    marker=marker,
                    ms=3.5,
                    alpha=1.0 if allocation == "shuffled" else 0.55,
                    label=f"{label}, {allocation}",
                )
        ax.axhline(1.0, color="#4c72b0", linewidth=0.6, linestyle=":")
        ax.axhline(20.0, color="#dd8452", linewidth=0.6, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}k"))
        ax.set_xticks(sorted({r["tokens"] for r in rows}))
        ax.set_xlabel("context length T (tokens), no prefix hit")
        ax.set_title(model, loc="left", fontsize=9)
        ax.grid(True, which="major", linewidth=0.4, alpha=0.6)
    axes[0][0].set_ylabel("ms per request (best of 15)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=7, bbox_to_anchor=(0.5, -0.28))
    return _save(fig)
