"""The ``kvspec`` command line: ``plan`` a preset's transfer, ``conform`` a backend, ``vectors``, the engine audits."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn, TextIO

import attrs

import kvspec.tools._vectors_check as _vectors_check
from kvspec._version import __version__
from kvspec.core._enums import TransferMode
from kvspec.core._errors import KVSpecError
from kvspec.core._models import BlockIds, KVCacheConfig, MambaSpec, SlidingWindowSpec
from kvspec.protocol._summary import (
    ParallelPlanSummary,
    PlanSummary,
    blocks_needed_for,
    summarize_parallel_plan,
    summarize_plan,
)
from kvspec.reference._messages import PROTOCOL_VERSION
from kvspec.reference._offload import (
    OffloadConfig,
    check_offload_support,
    get_chunk_sizes,
    get_load_set,
    get_offload_hit_tokens,
    get_store_set,
)
from kvspec.reference._presets import get_preset, list_presets
from kvspec.reference._reference import check_hybrid_support, get_logical_block_count, get_pruned_block_ids
from kvspec.spec.parallel import PageOrder

__all__ = [
    "MAX_PLAN_TOKENS",
    "build_parser",
    "main",
    "offload_summary",
    "plan_summary_to_dict",
    "run_command",
    "version_line",
]

_LAYOUTS = ("blocks_first", "layers_first", "per_layer", "shared")

MAX_PLAN_TOKENS = 10_000_000
"""Most tokens ``kvspec plan --tokens`` accepts: 10M, the longest context an open model ships (Llama 4 Scout).

``plan`` builds every block id of the request (about 40 bytes and 0.4 µs
a token), so a bound refuses ``--tokens 1000000000000`` before allocating.
"""

_USAGE_ERRORS = (
    KVSpecError,
    OSError,
    ValueError,
    TypeError,
    ImportError,
    LookupError,
    AttributeError,
    MemoryError,
    RecursionError,
)
"""What bad input (arguments, files, addresses, option keys, factories) raises; one line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (the usage itself is under ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def version_line() -> str:
    """``kvspec --version``: the package version and the protocol version it speaks (docs/explanation/versioning.md)."""
    major, minor = PROTOCOL_VERSION
    return f"kvspec {__version__} (protocol {major}.{minor})"


MAX_AUDIT_REQUESTS = 100_000
"""Most random requests ``kvspec vllm-audit --requests`` accepts (a bound on the work asked)."""


def _audit_requests(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_AUDIT_REQUESTS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_AUDIT_REQUESTS} requests, got {value}")
    return value


def _audit_state_requests(text: str) -> int:
    value = _non_negative_int(text)
    if value > MAX_AUDIT_REQUESTS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_AUDIT_REQUESTS} requests, got {value}")
    return value


def _plan_tokens(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_PLAN_TOKENS:  # refuse before building ids for every block of the request
        raise argparse.ArgumentTypeError(f"expected at most {MAX_PLAN_TOKENS} tokens, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its ``plan``, ``conform`` and ``vectors`` subcommands."""
    parser = _Parser(prog="kvspec", description="Hybrid KV-cache hand-off: reference and suite.")
    parser.add_argument("--version", action="version", version=version_line())
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
    plan.add_argument(
        "--tokens",
        type=_plan_tokens,
        required=True,
        metavar="N",
        help=f"tokens in the request (T), at most {MAX_PLAN_TOKENS}",
    )
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
    plan.add_argument(
        "--offload",
        action="store_true",
        help="show the offload path instead (OFF-1 ... OFF-9): per group, chunks and bytes one request stores, "
        "and what a later request of the same tokens loads on a full hit",
    )
    plan.add_argument(
        "--blocks-per-chunk",
        type=_positive_int,
        default=1,
        metavar="F",
        help="with --offload: GPU blocks per chunk (vLLM's blocks_per_chunk; default 1)",
    )
    plan.add_argument(
        "--state-cache-mode",
        choices=["none", "align"],
        default=None,
        help="how state groups (Mamba, GDN, KDA) keep their state: 'align' keeps it at block ends (prefix "
        "caching on); default 'align' with --offload, which needs it (OFF-9), else 'none'",
    )
    for side, flag, what in (
        ("producer", "tp", "TP size of the producer (prefill) engine"),
        ("consumer", "tp", "TP size of the consumer (decode) engine"),
        ("producer", "pp", "PP stages of the producer engine, each holding a band of layers (PAR-7)"),
        ("consumer", "dcp", "DCP size of the consumer engine: its ranks hold interleaved tokens (PAR-8)"),
    ):
        plan.add_argument(
            f"--{side}-{flag}",
            type=_positive_int,
            default=None,
            metavar="N",
            help=f"{what}; any of these flags prints the plan per consumer rank (PAR-1 .. PAR-7)",
        )
    plan.add_argument(
        "--dcp-interleave",
        type=_positive_int,
        default=1,
        metavar="I",
        help="with --consumer-dcp: tokens dealt to each DCP rank in turn (default 1)",
    )
    plan.add_argument(
        "--page-order",
        choices=[o.value for o in PageOrder if o is not PageOrder.OPAQUE],
        default="hnd",
        help="with --producer-tp/--consumer-tp: attention pages head-major (hnd, vLLM) or token-major (nhd, SGLang)",
    )
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

    vectors = sub.add_parser(
        "vectors",
        help="write language-neutral JSON test vectors, or check another implementation against them",
        description="Language-neutral JSON test vectors generated from the reference (see the docs page "
        "'Implementing kvspec in another language').",
    )
    _vectors_check.add_arguments(vectors)
    vectors.set_defaults(handler=_vectors_check.run)

    _add_agent_parser(sub)
    _add_guard_parser(sub)

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
        metavar="NAME|MODULE:CLASS",
        help="connector to drive: moriio, nixl, mooncake, reference, or MODULE:CLASS of any vLLM connector class "
        "(a KVConnectorBase_V1 subclass); repeatable (default: moriio, nixl, mooncake)",
    )
    audit.add_argument(
        "--vllm-extra",
        action="append",
        default=[],
        metavar="KEY=VALUE|FILE.json",
        help="kv_connector_extra_config for the connector class (int/float/bool converted), or a JSON file; repeatable",
    )
    audit.add_argument(
        "--expect-file",
        metavar="NAME|PATH",
        help="deviation classes known to be found, CONNECTOR/CLASS=REASON lines (or 'vllm-audit', the shipped list): "
        "exit 0 when exactly these are found; without it any deviation exits 1",
    )
    audit.add_argument(
        "--allow-vllm-version",
        action="store_true",
        help="run on a vLLM release the adapters were not verified on (a warning instead of a refusal)",
    )
    audit.add_argument(
        "--requests",
        type=_audit_requests,
        default=200,
        metavar="N",
        help=f"random requests, at most {MAX_AUDIT_REQUESTS} (default 200)",
    )
    audit.add_argument(
        "--state-requests",
        type=_audit_state_requests,
        metavar="N",
        help="random requests on FA + Mamba/GDN configs (align and none cache modes, speculative slots), after "
        "the attention ones; 0 for none (default: --requests // 4)",
    )
    audit.add_argument(
        "--speculation-requests",
        type=_audit_state_requests,
        metavar="N",
        help="random requests on FA + state-group configs whose prefill and decode engines run different "
        "speculation (MTP depth, multi-module MTP, scratch slots), after the state ones; 0 for none "
        "(default: --requests // 10)",
    )
    audit.add_argument("--seed", type=_non_negative_int, default=11, metavar="S", help="random seed (default 11)")
    audit.add_argument("--json", metavar="PATH", help="also write the report as JSON (the findings page reads it)")
    audit.add_argument(
        "--offload",
        action="store_true",
        help="audit vLLM's OffloadingConnector scheduler (vllm:offloading) against the offload rules OFF-3 ... OFF-7 "
        "instead; --requests sets the random hit requests (default 200), --connector is not used",
    )
    audit.add_argument(
        "--tp",
        action="store_true",
        help="audit vLLM's NIXL mapping across TP sizes instead: --requests random layers (attention, MLA, "
        "Mamba-2, GDN) and TP pairs over {1, 2, 4, 8, 16}, every decode rank's bytes against kvspec's planner "
        "(PAR-1 .. PAR-4); --expect-file lines are tp/CLASS=REASON",
    )
    audit.set_defaults(handler=_run_vllm_audit)
    setup = sub.add_parser(
        "vllm-setup",
        help="print the commands that install vLLM for the CPU, as kvspec tests it (pipe them to bash)",
        description="vLLM's wheel without its CUDA dependencies, then only what it imports (kvspec[vllm] on a CPU).",
    )
    setup.add_argument("--print", action="store_true", required=True, help="print the shell commands")
    setup.add_argument(
        "--python", help="the interpreter whose pip installs (default: the Python running kvspec, sys.executable)"
    )
    setup.set_defaults(handler=_run_vllm_setup)
    saudit = sub.add_parser(
        "sglang-audit",
        help="drive random P/D requests through SGLang's own allocator, index building and pairing",
        description=(
            "Whole requests through SGLang 0.5.23's page allocator, its prefill and decode index building and each "
            "backend's pairing; every pair is checked by logical position (ALIGN-1, NULL-1, WIN-1). Needs "
            "kvspec[sglang] (kvspec sglang-setup --print | bash)."
        ),
    )
    saudit.add_argument(
        "--backend",
        action="append",
        choices=("mooncake", "nixl", "mori"),
        help="backend whose pairing to drive; repeatable (default: mooncake, nixl, mori)",
    )
    saudit.add_argument(
        "--expect-file",
        metavar="NAME|PATH",
        help="deviation classes known to be found, BACKEND/CLASS=REASON lines (or 'sglang-audit', the shipped list): "
        "exit 0 when exactly these are found; without it any deviation exits 1",
    )
    saudit.add_argument(
        "--requests",
        type=_audit_requests,
        default=200,
        metavar="N",
        help=f"random requests, at most {MAX_AUDIT_REQUESTS} (default 200)",
    )
    saudit.add_argument("--seed", type=_non_negative_int, default=11, metavar="S", help="random seed (default 11)")
    saudit.add_argument("--json", metavar="PATH", help="also write the report as JSON (the findings page reads it)")
    saudit.set_defaults(handler=_run_sglang_audit)
    ssetup = sub.add_parser(
        "sglang-setup",
        help="print the commands that install SGLang for the CPU, as kvspec tests it (pipe them to bash)",
        description="SGLang's wheel and what its disaggregation code imports, each with --no-deps (kvspec[sglang]).",
    )
    ssetup.add_argument("--print", action="store_true", required=True, help="print the shell commands")
    ssetup.add_argument(
        "--python", help="the interpreter whose pip installs (default: the Python running kvspec, sys.executable)"
    )
    ssetup.set_defaults(handler=_run_sglang_setup)
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
                "role": "state" if g.is_state else "attention",
                "page_size": g.page_size,
                "bytes_per_page": g.bytes_per_page,
                "state": (
                    {"mamba_type": g.mamba_type, "tensor_bytes": list(g.state_tensor_bytes)} if g.is_state else None
                ),
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
            "attention_bytes_clipped": summary.attention_bytes_clipped,
            "state_bytes_clipped": summary.state_bytes_clipped,
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
    header = ("group", "kind", "window", "layers", "page", "moves", "blocks", "clipped", "bytes", "clipped bytes")
    rows = [
        (
            str(g.group_index),
            f"{g.kind} ({g.mamba_type})" if g.is_state else g.kind,
            "-" if g.sliding_window is None else str(g.sliding_window),
            str(g.num_layers),
            _human(g.page_size),
            _human(g.bytes_per_page),
            str(g.blocks_unclipped),
            str(g.blocks_clipped),
            _human(g.bytes_unclipped),
            _human(g.bytes_clipped),
        )
        for g in summary.groups
    ]
    total = ("total", "", "", "", "", "", "", "", _human(summary.bytes_unclipped), _human(summary.bytes_clipped))
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
    if any(g.is_state for g in summary.groups):
        print(
            f"clipped: attention {_human(summary.attention_bytes_clipped)}, state "
            f"{_human(summary.state_bytes_clipped)} (one slot per state group, STATE-2; a state page moves its "
            "state tensors, never its padding, PLAN-1)",
            file=out,
        )
    print(
        f"descriptors: {summary.descriptors_clipped} clipped, {summary.descriptors_unclipped} unclipped "
        f"(fresh contiguous allocation; pages: {summary.pages_clipped} / {summary.pages_unclipped})",
        file=out,
    )


def _gpu_block_ids(config: KVCacheConfig, num_tokens: int) -> BlockIds:
    """Fresh ids for a request of ``num_tokens``, pruned as vLLM leaves window groups (WIN-1, OFF-6)."""
    ids, next_id = [], 1
    for group in config.kv_cache_groups:
        count = get_logical_block_count(group.kv_cache_spec, num_tokens=num_tokens)
        ids.append(range(next_id, next_id + count))
        next_id += count
    return get_pruned_block_ids(config, ids, num_computed_tokens=num_tokens)


def offload_summary(config: KVCacheConfig, *, num_tokens: int, offload: OffloadConfig) -> dict[str, Any]:
    """Per group: chunks and bytes one fresh request of ``num_tokens`` stores, and a full hit of the same tokens loads.

    The store runs once at the end of the request (O = N, nothing stored yet);
    the hit is a later request with the same N tokens, nothing on its GPU and
    every complete chunk present (OFF-3, OFF-5, OFF-6).
    """
    check_offload_support(config)
    sizes = get_chunk_sizes(config, blocks_per_chunk=offload.blocks_per_chunk, hash_block_size=offload.hash_block_size)
    stored_ids = [list(range(1, 1 + -(-num_tokens // g.kv_cache_spec.block_size))) for g in config.kv_cache_groups]
    store = get_store_set(
        config, stored_ids, num_offloadable_tokens=num_tokens, next_chunk=[0] * config.num_groups, offload=offload
    )
    present = [[True] * (num_tokens // size) for size in sizes]
    hit = get_offload_hit_tokens(config, present, num_tokens=num_tokens, local_hit_tokens=0, offload=offload)
    load = get_load_set(config, _gpu_block_ids(config, hit), num_tokens=hit, local_hit_tokens=0, offload=offload)
    groups = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        block_bytes = spec.page_size_bytes * len(group.layer_names)
        groups.append(
            {
                "group": g,
                "kind": spec.kind.value,
                "block_size": spec.block_size,
                "sliding_window": spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
                "num_layers": len(group.layer_names),
                "chunk_tokens": sizes[g],
                "chunk_bytes": block_bytes * offload.blocks_per_chunk,
                "chunks_stored": len(store.chunks[g]),
                "bytes_stored": store.num_blocks[g] * block_bytes,
                "chunks_loaded": len(load.chunks[g]),
                "blocks_loaded": load.num_blocks[g],
                "bytes_loaded": load.num_blocks[g] * block_bytes,
            }
        )
    return {
        "num_tokens": num_tokens,
        "blocks_per_chunk": offload.blocks_per_chunk,
        "hash_block_size": offload.hash_block_size,
        "hit_tokens": hit,
        "groups": groups,
        "total": {
            "bytes_stored": sum(row["bytes_stored"] for row in groups),
            "bytes_loaded": sum(row["bytes_loaded"] for row in groups),
        },
    }


def _print_offload(model: str, summary: dict[str, Any], out: TextIO) -> None:
    header = (
        "group",
        "kind",
        "window",
        "layers",
        "chunk",
        "stored",
        "stored bytes",
        "loaded",
        "blocks",
        "loaded bytes",
    )
    rows = [
        (
            str(g["group"]),
            g["kind"],
            "-" if g["sliding_window"] is None else str(g["sliding_window"]),
            str(g["num_layers"]),
            f"{g['chunk_tokens']} tok",
            str(g["chunks_stored"]),
            _human(g["bytes_stored"]),
            str(g["chunks_loaded"]),
            str(g["blocks_loaded"]),
            _human(g["bytes_loaded"]),
        )
        for g in summary["groups"]
    ]
    total = summary["total"]
    last = ("total", "", "", "", "", "", _human(total["bytes_stored"]), "", "", _human(total["bytes_loaded"]))
    widths = [max(len(r[i]) for r in (header, *rows, last)) for i in range(len(header))]
    print(
        f"{model}: offload of {summary['num_tokens']} tokens, f={summary['blocks_per_chunk']} "
        f"(hash block {summary['hash_block_size']}); a full hit loads {summary['hit_tokens']} tokens",
        file=out,
    )
    for row in (header, *rows, last):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)), file=out)
    if total["bytes_stored"]:
        print(
            f"a full hit reads {total['bytes_loaded'] / total['bytes_stored']:.1%} of what the request stored", file=out
        )


def _with_state_cache_mode(config: KVCacheConfig, mode: str | None) -> KVCacheConfig:
    """``config`` with every state group's cache mode set to ``mode`` (unchanged when ``mode`` is None)."""
    if mode is None:
        return config
    groups = [
        attrs.evolve(g, kv_cache_spec=attrs.evolve(g.kv_cache_spec, cache_mode=mode))
        if isinstance(g.kv_cache_spec, MambaSpec)
        else g
        for g in config.kv_cache_groups
    ]
    return attrs.evolve(config, kv_cache_groups=groups)


def _run_offload_plan(args: argparse.Namespace, preset: Any, out: TextIO) -> int:
    if args.state_cache_mode == "none" and any(isinstance(s, MambaSpec) for s in preset.layer_specs):
        print(
            f"kvspec plan: --offload with --state-cache-mode none: {preset.hf_id}'s state groups must keep their "
            "state at block ends for a load to restore it (OFF-9); use --state-cache-mode align (the default)",
            file=sys.stderr,
        )
        return 2
    # Offload needs prefix caching, so state groups keep their state at block ends unless told otherwise (OFF-9).
    config = _with_state_cache_mode(
        preset.build_config(num_blocks=2, block_size=args.block_size, layout=args.layout),
        args.state_cache_mode or "align",
    )
    hash_block = min(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
    offload = OffloadConfig(blocks_per_chunk=args.blocks_per_chunk, hash_block_size=hash_block)
    summary = offload_summary(config, num_tokens=args.tokens, offload=offload)
    if args.json:
        json.dump({"model": preset.hf_id, **summary}, out, indent=2)
        print(file=out)
    else:
        _print_offload(preset.hf_id, summary, out)
    return 0


def parallel_plan_to_dict(model: str, summary: ParallelPlanSummary) -> dict[str, Any]:
    """The JSON shape of ``kvspec plan --producer-tp P --consumer-tp D --json``: per consumer rank, its reads."""
    ranks = []
    for consumer_rank, dcp_rank in itertools.product(range(summary.consumer_tp), range(summary.consumer_dcp)):
        reads = [r for r in summary.reads if (r.consumer_rank, r.consumer_dcp_rank) == (consumer_rank, dcp_rank)]
        ranks.append(
            {
                "rank": consumer_rank,
                "dcp_rank": dcp_rank,
                "bytes": sum(r.nbytes for r in reads),
                "descriptors": sum(r.descriptors for r in reads),
                "notifies": list(summary.notified_ranks(consumer_rank)),
                "reads": [
                    {
                        "group": r.group_index,
                        "kind": r.kind,
                        "producer_stage": r.producer_stage,
                        "producer_rank": r.producer_rank,
                        "num_layers": r.num_layers,
                        "pages": r.pages,
                        "bytes_per_page": r.bytes_per_page,
                        "bytes": r.nbytes,
                        "descriptors": r.descriptors,
                        "copies_per_page": [
                            {
                                "producer_page": c.producer_page,
                                "producer_offset": c.producer_offset,
                                "consumer_offset": c.consumer_offset,
                                "nbytes": c.nbytes,
                            }
                            for c in r.copies
                        ],
                    }
                    for r in reads
                ],
            }
        )
    return {
        "model": model,
        "num_tokens": summary.base.num_tokens,
        "prefix_hit_tokens": summary.base.prefix_hit_tokens,
        "mode": summary.base.mode.value,
        "producer": {
            "tp": summary.producer_tp,
            "pp": summary.producer_pp,
            "completion_counts": [summary.completion_count(p) for p in range(summary.producer_tp)],
        },
        "consumer": {"tp": summary.consumer_tp, "dcp": summary.consumer_dcp, "dcp_interleave": summary.dcp_interleave},
        "consumer_ranks": ranks,
        "total_bytes": sum(r.nbytes for r in summary.reads),
    }


def _print_parallel(model: str, summary: ParallelPlanSummary, out: TextIO) -> None:
    base = summary.base
    print(
        f"{model}: {base.num_tokens} tokens, prefix hit {base.prefix_hit_tokens}, mode {base.mode.value}; "
        f"producer TP{summary.producer_tp} PP{summary.producer_pp} -> consumer TP{summary.consumer_tp}"
        + (f" DCP{summary.consumer_dcp} (interleave {summary.dcp_interleave})" if summary.consumer_dcp > 1 else ""),
        file=out,
    )
    for consumer_rank, dcp_rank in itertools.product(range(summary.consumer_tp), range(summary.consumer_dcp)):
        reads = [r for r in summary.reads if (r.consumer_rank, r.consumer_dcp_rank) == (consumer_rank, dcp_rank)]
        dcp = f" (DCP rank {dcp_rank})" if summary.consumer_dcp > 1 else ""
        print(
            f"consumer rank {consumer_rank}{dcp}: {_human(sum(r.nbytes for r in reads))} in "
            f"{sum(r.descriptors for r in reads)} descriptors; notifies producer ranks "
            f"{list(summary.notified_ranks(consumer_rank))}",
            file=out,
        )
        for r in reads:
            stage = f"stage {r.producer_stage} " if summary.producer_pp > 1 else ""
            print(
                f"  group {r.group_index} ({r.kind}) from {stage}rank {r.producer_rank}: {r.num_layers} layers x "
                f"{r.pages} pages x {_human(r.bytes_per_page)} in {len(r.copies)} runs = {_human(r.nbytes)}",
                file=out,
            )
    counts = [summary.completion_count(p) for p in range(summary.producer_tp)]
    print(f"each producer rank frees after {counts} notifications (PAR-6)", file=out)


def _run_parallel_plan(args: argparse.Namespace, preset: Any, mode: TransferMode, out: TextIO) -> int:
    sizing = preset.build_config(num_blocks=2, block_size=args.block_size, layout=args.layout)
    config = preset.build_config(
        num_blocks=blocks_needed_for(sizing, num_tokens=args.tokens), block_size=args.block_size, layout=args.layout
    )
    order = PageOrder(args.page_order)
    pages = [preset.get_canonical_page(g.kv_cache_spec, order=order) for g in config.kv_cache_groups]
    summary = summarize_parallel_plan(
        config,
        pages,
        num_tokens=args.tokens,
        prefix_hit_tokens=args.prefix_hit,
        mode=mode,
        producer_tp=args.producer_tp or 1,
        consumer_tp=args.consumer_tp or 1,
        producer_pp=args.producer_pp or 1,
        consumer_dcp=args.consumer_dcp or 1,
        dcp_interleave=args.dcp_interleave,
    )
    if args.json:
        json.dump(parallel_plan_to_dict(preset.hf_id, summary), out, indent=2)
        print(file=out)
    else:
        _print_parallel(preset.hf_id, summary, out)
    return 0


def _run_plan(args: argparse.Namespace, out: TextIO) -> int:
    preset = get_preset(args.model)
    if args.offload:
        return _run_offload_plan(args, preset, out)
    mode = TransferMode(args.mode)
    sizing = _with_state_cache_mode(
        preset.build_config(num_blocks=2, block_size=args.block_size, layout=args.layout), args.state_cache_mode
    )
    # The whole config is admitted, state groups included (ADM-1; decision 167 in decisions-offload.md).
    check_hybrid_support(sizing, mode=mode)
    if (args.producer_tp, args.consumer_tp, args.producer_pp, args.consumer_dcp) != (None,) * 4:
        return _run_parallel_plan(args, preset, mode, out)
    config = _with_state_cache_mode(
        preset.build_config(
            num_blocks=blocks_needed_for(sizing, num_tokens=args.tokens), block_size=args.block_size, layout=args.layout
        ),
        args.state_cache_mode,
    )
    summary = summarize_plan(config, num_tokens=args.tokens, prefix_hit_tokens=args.prefix_hit, mode=mode)
    if args.json:
        json.dump(plan_summary_to_dict(preset.hf_id, summary), out, indent=2)
        print(file=out)
    else:
        _print_table(preset.hf_id, summary, out)
    return 0


# --------------------------------------------------------------------------- guard


def _add_guard_parser(sub: Any) -> None:
    guard = sub.add_parser(
        "guard",
        help="check the guard's verify path (INT-2, INT-3)",
        description="The guard: the rule checks and the INT-2 digest a consumer runs before a request loads.",
    )
    guard_sub = guard.add_subparsers(dest="guard_command", required=True, metavar="ACTION")
    selftest = guard_sub.add_parser(
        "selftest",
        help="inject seeded mismatches through the guard's verify path; exit non-zero unless each is caught",
        description="Inject a wrong page, a wrong slot, a stale page, a flipped byte and an unclipped list into "
        "one request, run the guard's verify path on each, and report that each was caught (and that a clean "
        "request loads). Exits 1 if any was missed.",
    )
    selftest.add_argument("--seed", type=_non_negative_int, default=0, help="which pages and places (default 0)")
    selftest.add_argument("--producer-tp", type=_positive_int, default=1, metavar="N", help="default 1")
    selftest.add_argument("--consumer-tp", type=_positive_int, default=2, metavar="N", help="default 2")
    selftest.add_argument(
        "--offset", type=_non_negative_int, default=0, metavar="BYTE", help="the byte to flip in a rank's page"
    )
    selftest.add_argument("--algorithm", default="xxh3-128", choices=["xxh3-128", "blake2b-128"])
    selftest.add_argument("--mode", default="full", choices=["full", "partial"], help="INT-2 mode (default full)")
    selftest.set_defaults(handler=_run_guard_selftest)


def _run_guard_selftest(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.spec.digest import DigestPolicy
    from kvspec.tools._guard_selftest import run_selftest

    if args.producer_tp > 64 or args.consumer_tp > 64:
        raise KVSpecError(
            f"--producer-tp, --consumer-tp: expected at most 64, got {args.producer_tp}, {args.consumer_tp}"
        )
    policy = DigestPolicy(algorithm=args.algorithm, mode=args.mode)
    results = run_selftest(
        seed=args.seed, producer_tp=args.producer_tp, consumer_tp=args.consumer_tp, offset=args.offset, policy=policy
    )
    print(
        f"kvspec guard selftest: TP {args.producer_tp} -> {args.consumer_tp}, {policy.algorithm.value} "
        f"{policy.mode.value}, seed {args.seed}",
        file=out,
    )
    for result in results:
        word = "ok    " if result.ok else "MISSED"
        if result.case == "clean":
            said = "loaded, no verdict" if result.verdict is None else f"false alarm: {result.verdict.message}"
        elif result.verdict is None:
            said = "no verdict: the request would have loaded"
        else:
            where = f", first differing page {result.verdict.page}" if result.verdict.page else ""
            said = f"caught by {result.verdict.rule}{where}; the request fails"
        print(f"{word} {result.case:<15} {said}", file=out)
    missed = [r.case for r in results if not r.ok]
    print("every injected mismatch was caught" if not missed else f"missed: {', '.join(missed)}", file=out)
    return 1 if missed else 0


# --------------------------------------------------------------------------- agent


def _add_agent_parser(sub: Any) -> None:
    agent = sub.add_parser(
        "agent",
        help="run a backend's agents for a suite on another host (kvspec conform --peer)",
        description="The remote half of a two-host suite run (docs/how-to/run-across-two-hosts.md).",
    )
    agent_sub = agent.add_subparsers(dest="agent_command", required=True, metavar="ACTION")
    serve = agent_sub.add_parser(
        "serve",
        help="own pools and agents of BACKEND and serve one authenticated suite client over TCP",
        description=(
            "Serve one client at a time on HOST:PORT: pools, fills, digests and the agents of BACKEND, "
            "after a challenge-response over the shared token. No TLS: run it on a trusted network."
        ),
    )
    serve.add_argument("backend", help="backend name, as for kvspec conform (nixl, torch, loopback)")
    serve.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to listen on")
    serve.add_argument(
        "--token-file",
        metavar="F",
        help="file holding the shared token (at least 16 bytes); default: the KVSPEC_AGENT_TOKEN environment variable",
    )
    serve.add_argument(
        "--max-pool",
        type=_positive_int,
        default=1 << 30,
        metavar="BYTES",
        help="most bytes of pool memory one client may hold at once (default 1 GiB)",
    )
    serve.add_argument(
        "--max-posted",
        type=_positive_int,
        default=256 << 20,
        metavar="BYTES",
        help="most bytes one client's unreleased posts may hold: 40 a descriptor, 4096 a post, plus the "
        "notification (default 256 MiB)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=_positive_int,
        default=600,
        metavar="SECONDS",
        help="drop a client that sends no request for this long and free what it held (default 600)",
    )
    serve.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword option for the backend factory, as for kvspec conform; repeatable",
    )
    serve.set_defaults(handler=_run_agent_serve)


def _run_agent_serve(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.remote._server import serve_command

    args.option = _listen_options(args.backend, args.listen, args.option) + list(args.option)
    return serve_command(args, out)


def _listen_options(backend: str, listen: str, given: list[str]) -> list[str]:
    """``KEY=VALUE`` options the ``--listen`` address implies for a built-in backend (``--option`` wins)."""
    from kvspec.remote._client import parse_address
    from kvspec.transport._netaddr import derived_options
    from kvspec.transport._registry import parse_backend_options

    try:
        host, _ = parse_address(listen)
        options = parse_backend_options(given)
    except (KVSpecError, ValueError):
        return []  # serve_command reports the bad address or option in one line
    return [f"{key}={value}" for key, value in derived_options(backend, host, options).items()]


# --------------------------------------------------------------------------- conform


# The suite registers its command line here (pyproject.toml); kvspec never imports the suite by name,
# so the package that sits above kvspec stays above it (docs/explanation/layers.md).
SUITE_ENTRY_POINT_GROUP = "kvspec.suite"


def _suite_cli() -> Any:
    """The module behind ``kvspec conform`` (``add_arguments``, ``run``), found through its entry point.

    ``None`` when no installed distribution declares ``conform`` in the ``kvspec.suite``
    group, or when the module it names does not import.
    """
    found = [ep for ep in entry_points(group=SUITE_ENTRY_POINT_GROUP) if ep.name == "conform"]
    if not found:
        return None
    try:
        return found[0].load()
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
    from kvspec.integrations.expectations import load_expected
    from kvspec.integrations.vllm import check_vllm_version, parse_vllm_extra, vllm_connector
    from kvspec.integrations.vllm_audit import check_expected, run_audit

    if args.offload:
        return _run_offload_audit(args, out)
    if args.tp:
        return _run_tp_audit(args, out)
    try:
        warning = check_vllm_version(allow=args.allow_vllm_version)
        extra = parse_vllm_extra(args.vllm_extra)
        expected = load_expected(args.expect_file) if args.expect_file else None
        connectors = [
            name if name == "reference" or (":" not in name and not extra) else vllm_connector(name, extra_config=extra)
            for name in args.connector or ("moriio", "nixl", "mooncake")
        ]
        if warning:
            print(f"kvspec vllm-audit: {warning}", file=sys.stderr)
        report = run_audit(
            connectors=connectors,  # type: ignore[arg-type]
            requests=args.requests,
            seed=args.seed,
            state_requests=args.state_requests,
            speculation_requests=args.speculation_requests,
        )
    except (KVSpecError, ValueError) as exc:
        print(f"kvspec vllm-audit: {exc}", file=sys.stderr)
        return 2
    out.write(report.render())
    if args.json:
        report.write_json(args.json)
    problems = check_expected(report, expected or {})
    for problem in problems:
        out.write(f"FAILED {problem}\n")
    out.write(("FAILED" if problems else "PASSED") + f": {len(problems)} unexpected or vanished deviation classes\n")
    return 1 if problems else 0


def _run_tp_audit(args: argparse.Namespace, out: TextIO) -> int:
    """``kvspec vllm-audit --tp``: vLLM's NIXL TP mapping against kvspec's on random layers and TP pairs."""
    from kvspec.integrations.expectations import load_expected
    from kvspec.integrations.vllm import check_vllm_version, make_connector
    from kvspec.integrations.vllm_parallel import audit_tp_pairs

    try:
        warning = check_vllm_version(allow=args.allow_vllm_version)
        expected = load_expected(args.expect_file) if args.expect_file else {}
        make_connector("nixl")  # imports vLLM's NIXL modules, one clear line if they do not
        if warning:
            print(f"kvspec vllm-audit: {warning}", file=sys.stderr)
        report = audit_tp_pairs(requests=args.requests, seed=args.seed)
    except (KVSpecError, ValueError) as exc:
        print(f"kvspec vllm-audit --tp: {exc}", file=sys.stderr)
        return 2
    out.write(report.render())
    found = {f"tp/{name}" for name in report.classes}
    listed = {key for key in expected if key.startswith("tp/")}
    problems = [f"{key}: found, not expected" for key in sorted(found - listed)]
    problems += [f"{key}: expected, no longer found" for key in sorted(listed - found)]
    for problem in problems:
        out.write(f"FAILED {problem}\n")
    out.write(("FAILED" if problems else "PASSED") + f": {len(problems)} unexpected or vanished deviation classes\n")
    return 1 if problems else 0


def _run_sglang_audit(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.integrations.expectations import load_expected
    from kvspec.integrations.sglang import check_sglang_version
    from kvspec.integrations.sglang_audit import AUDIT_BACKENDS, check_expected, run_audit

    try:
        check_sglang_version()
        expected = load_expected(args.expect_file) if args.expect_file else None
        report = run_audit(backends=tuple(args.backend or AUDIT_BACKENDS), requests=args.requests, seed=args.seed)
    except (KVSpecError, ValueError) as exc:
        print(f"kvspec sglang-audit: {exc}", file=sys.stderr)
        return 2
    out.write(report.render())
    if args.json:
        report.write_json(args.json)
    problems = check_expected(report, expected or {})
    for problem in problems:
        out.write(f"FAILED {problem}\n")
    out.write(("FAILED" if problems else "PASSED") + f": {len(problems)} unexpected or vanished deviation classes\n")
    return 1 if problems else 0


def _run_sglang_setup(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.integrations.sglang import cpu_setup_script

    out.write(cpu_setup_script(args.python))
    return 0


def _run_vllm_setup(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.integrations.vllm import cpu_setup_script

    out.write(cpu_setup_script(args.python))
    return 0


def _run_offload_audit(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.integrations.vllm_offload_audit import run_offload_audit

    try:
        report = run_offload_audit(seed=args.seed, random_requests=args.requests)
    except KVSpecError as exc:
        print(f"kvspec vllm-audit --offload: {exc}", file=sys.stderr)
        return 2
    out.write(report.render())
    if args.json:
        report.write_json(args.json)
    return 0


def run_command(prog: str, call: Callable[[], int], out: TextIO) -> int:
    """``call()``'s exit status, with every way a command can end on bad input turned into one stderr line.

    The one place the ``kvspec`` commands map errors: a kvspec error or a bad
    file, address, option or factory (``_USAGE_ERRORS``) is one line naming it
    and status 2, as is a subcommand's ``SystemExit("message")``; Ctrl-C is
    one line and 130; a closed pipe (``kvspec plan ... | head``) ends quietly
    with 141, as a command killed by SIGPIPE does; any other exception, a
    kvspec bug, is one line and 1 (``KVSPEC_DEBUG=1`` shows the traceback).
    """
    try:
        status = call()
        out.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        _silence_stdout(out)
        return 141
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print(" ".join(stop.code.split()), file=sys.stderr)  # a subcommand's own one-line refusal: usage
        return 2
    except _USAGE_ERRORS as exc:
        if os.environ.get("KVSPEC_DEBUG"):
            raise
        print(f"{prog}: {_describe(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if os.environ.get("KVSPEC_DEBUG"):
            raise
        print(f"{prog}: internal error: {_describe(exc)} (KVSPEC_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def _describe(exc: BaseException) -> str:
    """One line: the error's class and message; for an OSError its reason and the file or address."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename is not None else ""
        text = f"{type(exc).__name__}: {exc.strerror}{where}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:2000]  # one line, however the message was built


def _silence_stdout(out: TextIO) -> None:
    """Point stdout at /dev/null, so the interpreter's last flush cannot fail again (Python docs, SIGPIPE)."""
    if out is sys.stdout:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of the ``kvspec`` command; returns the exit status."""
    stream = sys.stdout if out is None else out
    args = build_parser().parse_args(argv)
    status: int = run_command(f"kvspec {args.command}", lambda: int(args.handler(args, stream)), stream)
    return status
