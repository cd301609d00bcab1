"""The ``kvspec`` command line: ``plan`` a preset's transfer, ``conform`` a backend, ``vllm-audit`` vLLM."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from kvspec._enums import TransferMode
from kvspec._errors import KVSpecError
from kvspec._presets import get_preset, list_presets
from kvspec._reference import check_hybrid_support
from kvspec._summary import PlanSummary, blocks_needed_for, summarize_plan

__all__ = ["build_parser", "main", "plan_summary_to_dict"]

_LAYOUTS = ("blocks_first", "layers_first", "per_layer", "shared")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its ``plan`` and ``conform`` subcommands."""
    parser = argparse.ArgumentParser(prog="kvspec", description="Hybrid KV-cache hand-off: reference and suite.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    aliases = ", ".join(p.alias for p in list_presets())
    plan = sub.add_parser(
        "plan",
        help="show what one request moves for a preset model, with and without clipping",
        description=(
            "Per KV-cache group: blocks and bytes moved for one request of N tokens, without clipping "
            "(every block of the uncached suffix) and with clipping (CLIP-1, WIN-1), plus the number of "
            f"descriptors for fresh contiguous allocations (PLAN-1). Presets: {aliases}."
        ),
    )
    plan.add_argument("model", metavar="MODEL", help="preset name: Hugging Face id or alias, e.g. gemma-3-27b")
    plan.add_argument("--tokens", type=_positive_int, required=True, metavar="N", help="tokens in the request (T)")
    plan.add_argument(
        "--prefix-hit",
        type=_non_negative_int,
        default=0,
        metavar="M",
        help="tokens the consumer already holds (H); a multiple of every block size",
    )
    plan.add_argument("--mode", choices=[m.value for m in TransferMode], default="read", help="READ or WRITE")
    plan.add_argument("--block-size", type=_positive_int, default=16, help="block size of every group (default 16)")
    plan.add_argument("--layout", choices=_LAYOUTS, default="blocks_first", help="memory layout of the pools")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(handler=_run_plan)

    conform = sub.add_parser(
        "conform",
        help="run the conformance suite against a backend",
        description="Run the conformance suite (kvspec_conformance) against a transport backend.",
    )
    suite_cli = _suite_cli()
    if suite_cli is not None:
        suite_cli.add_arguments(conform)
    else:  # accept anything, so the handler can say how to install the suite
        conform.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    conform.set_defaults(handler=_run_conform)

    audit = sub.add_parser(
        "vllm-audit",
        help="drive random P/D requests through vLLM's own managers and connectors, report each deviation",
        description=(
            "Whole requests through vLLM 0.33.0's KVCacheManagers and each connector's scheduler hooks, in "
            "vLLM's scheduler order; every pair the connector would post is checked by logical position "
            "(ALIGN-1, NULL-1, WIN-1). Needs kvspec[vllm]. 'reference' runs kvspec's own functions instead."
        ),
    )
    audit.add_argument(
        "--connector",
        action="append",
        choices=["moriio", "nixl", "mooncake", "reference"],
        help="connector to drive; repeatable (default: moriio, nixl, mooncake)",
    )
    audit.add_argument("--requests", type=_positive_int, default=200, metavar="N", help="random requests (default 200)")
    audit.add_argument("--seed", type=_non_negative_int, default=11, metavar="S", help="random seed (default 11)")
    audit.add_argument("--json", metavar="PATH", help="also write the report as JSON (the findings page reads it)")
    audit.set_defaults(handler=_run_vllm_audit)
    return parser


# --------------------------------------------------------------------------- plan


def plan_summary_to_dict(model: str, summary: PlanSummary) -> dict[str, Any]:
    """The JSON shape of ``kvspec plan --json``."""
    return {
        "model": model,
        "num_tokens": summary.num_tokens,
        "prefix_hit_tokens": summary.prefix_hit_tokens,
        "mode": summary.mode.value,
        "groups": [
            {
                "group": g.group_index,
                "kind": g.kind,
                "block_size": g.block_size,
                "sliding_window": g.sliding_window,
                "num_layers": g.num_layers,
                "page_size": g.page_size,
                "blocks_unclipped": g.blocks_unclipped,
                "blocks_clipped": g.blocks_clipped,
                "bytes_unclipped": g.bytes_unclipped,
                "bytes_clipped": g.bytes_clipped,
            }
            for g in summary.groups
        ],
        "total": {
            "bytes_unclipped": summary.bytes_unclipped,
            "bytes_clipped": summary.bytes_clipped,
            "bytes_saved": summary.bytes_saved,
            "pages_unclipped": summary.pages_unclipped,
            "pages_clipped": summary.pages_clipped,
            "descriptors_unclipped": summary.descriptors_unclipped,
            "descriptors_clipped": summary.descriptors_clipped,
        },
    }


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _print_table(model: str, summary: PlanSummary, out: TextIO) -> None:
    header = ("group", "kind", "window", "layers", "page", "blocks", "clipped", "bytes", "clipped bytes")
    rows = [
        (
            str(g.group_index),
            g.kind,
            "-" if g.sliding_window is None else str(g.sliding_window),
            str(g.num_layers),
            _human(g.page_size),
            str(g.blocks_unclipped),
            str(g.blocks_clipped),
            _human(g.bytes_unclipped),
            _human(g.bytes_clipped),
        )
        for g in summary.groups
    ]
    total = ("total", "", "", "", "", "", "", _human(summary.bytes_unclipped), _human(summary.bytes_clipped))
    widths = [max(len(r[i]) for r in (header, *rows, total)) for i in range(len(header))]
    print(
        f"{model}: {summary.num_tokens} tokens, prefix hit {summary.prefix_hit_tokens}, mode {summary.mode.value}",
        file=out,
    )
    for row in (header, *rows, total):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)), file=out)
    saved = summary.bytes_saved
    share = saved / summary.bytes_unclipped if summary.bytes_unclipped else 0.0
    print(f"clipping saves {_human(saved)} ({share:.1%})", file=out)
    print(
        f"descriptors: {summary.descriptors_clipped} clipped, {summary.descriptors_unclipped} unclipped "
        f"(fresh contiguous allocation; pages: {summary.pages_clipped} / {summary.pages_unclipped})",
        file=out,
    )


def _run_plan(args: argparse.Namespace, out: TextIO) -> int:
    preset = get_preset(args.model)
    mode = TransferMode(args.mode)
    sizing = preset.build_config(num_blocks=2, block_size=args.block_size, layout=args.layout)
    check_hybrid_support(sizing, mode=mode)
    config = preset.build_config(
        num_blocks=blocks_needed_for(sizing, num_tokens=args.tokens), block_size=args.block_size, layout=args.layout
    )
    summary = summarize_plan(config, num_tokens=args.tokens, prefix_hit_tokens=args.prefix_hit, mode=mode)
    if args.json:
        json.dump(plan_summary_to_dict(preset.hf_id, summary), out, indent=2)
        print(file=out)
    else:
        _print_table(preset.hf_id, summary, out)
    return 0


# --------------------------------------------------------------------------- conform


def _suite_cli() -> Any:
    try:
        return importlib.import_module("kvspec_conformance.cli")
    except ImportError:
        return None


def _run_conform(args: argparse.Namespace, out: TextIO) -> int:
    suite_cli = _suite_cli()
    if suite_cli is None:
        print(
            "kvspec conform: the conformance suite is not importable; "
            "install it with: pip install 'kvspec[conformance]'",
            file=sys.stderr,
        )
        return 2
    return int(suite_cli.run(args) or 0)


def _run_vllm_audit(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.integrations.vllm_audit import run_audit

    try:
        report = run_audit(
            connectors=args.connector or ("moriio", "nixl", "mooncake"), requests=args.requests, seed=args.seed
        )
    except KVSpecError as exc:
        print(f"kvspec vllm-audit: {exc}", file=sys.stderr)
        return 2
    out.write(report.render())
    if args.json:
        report.write_json(args.json)
    return 0


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of the ``kvspec`` command; returns the exit status."""
    stream = sys.stdout if out is None else out
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args, stream)
    except KVSpecError as exc:
        print(f"kvspec {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return status
