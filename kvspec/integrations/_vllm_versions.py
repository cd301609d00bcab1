"""Which vLLM release is installed, and what kvspec's adapters do differently on each verified one.

kvspec's vLLM adapters are verified on 0.33.0 and 0.34.0. Where vLLM's own
API differs between them, the adapter asks this module, never the version
string itself, so every version-dependent choice is listed here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from collections.abc import Iterator
from typing import Any

__all__ = [
    "VERIFIED_VLLM_VERSIONS",
    "cpu_config_scope",
    "expected_file_stem",
    "installed_vllm_version",
    "moriio_attention_groups",
    "nixl_mamba_remote_pairs",
    "schedule_whole_block_table",
    "vllm_release",
]

VERIFIED_VLLM_VERSIONS = ("0.33.0", "0.34.0")
"""vLLM releases the adapters were verified on; another one warns, or is refused without ``--allow-vllm-version``."""

_TRITON_CHECKED = (0, 34)
"""From 0.34, ``CpuPlatform.check_and_update_config`` refuses an x86 CPU without Triton's CPU backend."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its package metadata, or None without vLLM."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed vLLM), ``(0, 0)`` without vLLM or a number."""
    found = installed_vllm_version() if version is None else version
    parts = (found or "").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def expected_file_stem(name: str) -> str:
    """The shipped list for ``name`` on the installed vLLM: ``vllm-nixl`` on 0.33, ``vllm-nixl-0.34`` on 0.34.

    0.33.0's lists keep their historic names; a later verified release has
    its own list, ``<name>-<major>.<minor>``, since its connectors fail other cases.
    """
    release = vllm_release()
    if release <= (0, 33) or release == (0, 0):
        return name
    return f"{name}-{release[0]}.{release[1]}"


@contextlib.contextmanager
def cpu_config_scope() -> Iterator[None]:
    """While vLLM builds a ``VllmConfig`` for kvspec, let its CPU platform check pass without triton-cpu.

    vLLM 0.34's ``CpuPlatform.check_and_update_config`` raises "vLLM on x86
    CPUs requires Triton (triton-cpu)" when ``vllm.triton_utils.HAS_TRITON``
    is false: triton-cpu is what vLLM's CPU *model runner* compiles its
    kernels with. kvspec builds no model runner; it drives the connectors'
    scheduler-side and pairing code, which never calls Triton. triton-cpu is
    not on PyPI, and plain ``triton`` (3.9 ships with torch here) finds no
    active driver on a CPU, so ``HAS_TRITON`` stays false. kvspec therefore
    reads ``HAS_TRITON`` as true for the length of the constructor call only
    and puts the real value back at once; nothing vLLM imports meanwhile binds
    the changed value (its kernel modules read ``HAS_TRITON`` at their own import,
    which kvspec never triggers inside this scope). On 0.33 this does nothing.
    """
    if vllm_release() < _TRITON_CHECKED:
        yield
        return
    triton_utils: Any = importlib.import_module("vllm.triton_utils")
    real = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = real


def nixl_mamba_remote_pairs(base_worker: Any, num_regions: int) -> tuple[Any, ...]:
    """The extra arguments 0.34's ``NixlBaseConnectorWorker._build_mamba_remote`` takes: the region pairing.

    NIXL's wire version 16 (vLLM 0.34) pairs the peer's regions with the local
    ones by the layers both hold; ``_build_mamba_remote`` reads the peer's SSM
    regions from that pairing (``_RegionPairs.remote_ssm_regions``) instead of
    taking every region as 0.33 did. kvspec's parallel adapter hands it one
    SSM region per state layer, in order, which is 0.33's reading; on 0.33 no
    argument is added.
    """
    if vllm_release() < (0, 34):
        return ()
    pairs = base_worker._RegionPairs(
        remote=[], local=[], group=[], remote_regions=[], partner=[], remote_ssm_regions=list(range(num_regions))
    )
    return (pairs,)


def schedule_whole_block_table(output_module: Any, out: Any, request: Any, block_ids: tuple[list[int], ...]) -> None:
    """Put ``request`` with its whole block table into the ``SchedulerOutput`` ``out``, as a resumed request.

    0.33 sends a resumed request among the cached ones, flagged in
    ``CachedRequestData.resumed_req_ids``; 0.34 dropped that set and sends it
    among the new ones (``NewRequestData``), whose block ids connectors take
    as the whole table (``yield_req_data``'s ``is_full_table``).
    """
    if vllm_release() < (0, 34):
        cached = output_module.CachedRequestData.make_empty()
        cached.req_ids.append(request.request_id)
        cached.resumed_req_ids.add(request.request_id)
        cached.new_token_ids.append([])
        cached.new_block_ids.append(block_ids)
        cached.num_computed_tokens.append(request.num_computed_tokens)
        cached.num_output_tokens.append(request.num_output_tokens)
        out.scheduled_cached_reqs = cached
        return
    tokens = list(request.all_token_ids)
    out.scheduled_new_reqs.append(output_module.NewRequestData.from_request(request, block_ids, tokens))


def moriio_attention_groups(attention: Any) -> list[list[int]]:
    """The attention part of MoRI-IO's ``split_block_groups`` as one list per attention group.

    0.33's hybrid READ holds one attention group and returns its list; 0.34
    admits several (FA + SW + Mamba) and returns one list per attention group,
    "every attention group first, followed by every Mamba group" on the wire.
    """
    if vllm_release() < (0, 34):
        return [list(attention)]
    return [list(group) for group in attention]
