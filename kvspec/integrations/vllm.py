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
import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvspec._errors import (
    BackendUnavailableError,
    BlockAlignmentError,
    ConfigError,
    GroupCountError,
    UnsupportedHybridError,
)
from kvspec._handshake import check_compatibility
from kvspec._models import (
    BlockIds,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    DType,
    FullAttentionSpec,
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
from kvspec._plan import BlockPairsLike, TransferPlan, plan_transfer
from kvspec._reference import BlockPairs

__all__ = [
    "CONNECTORS",
    "VLLM_VERSION",
    "MooncakeConnector",
    "MoriioConnector",
    "NixlConnector",
    "NixlPushConnector",
    "RawPairs",
    "VllmConnector",
    "build_scheduler",
    "build_vllm_config",
    "from_vllm_kv_cache_config",
    "import_vllm",
    "make_connector",
    "pair_mooncake",
    "pair_moriio",
    "pair_nixl",
    "to_vllm_kv_cache_config",
]

VLLM_VERSION = "0.33.0"
"""The vLLM release the adapters and the findings page were written against."""

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
            f"kvspec.integrations.vllm needs vllm=={VLLM_VERSION} (pip install 'kvspec[vllm]'; on a CPU-only "
            f"machine see docs/how-to/vllm-connector.md): cannot import {module}: {exc}"
        ) from exc
    if quiet and not _QUIETED:
        # vLLM warns at import about the missing GPU, Triton and RDMA libraries; none concerns block logic.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        _QUIETED.append(True)
    return imported


_QUIETED: list[bool] = []


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
}
_KVSPEC_BY_NAME = {name: cls for cls, name in _SPEC_NAMES.items()}
_ATTENTION_FIELDS = ("block_size", "num_kv_heads", "head_size", "page_size_padded")
_EXTRA_FIELDS: dict[type[KVCacheSpec], tuple[str, ...]] = {
    FullAttentionSpec: ("sliding_window", "attention_chunk_size"),
    MLAAttentionSpec: ("sliding_window", "attention_chunk_size"),
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
        return target(
            block_size=spec.block_size,
            shapes=tuple(spec.shapes),
            dtypes=tuple(_torch_dtype(d) for d in spec.dtypes),
            page_size_padded=spec.page_size_padded,
            mamba_type=spec.mamba_type,
        )
    assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec))
    kwargs: dict[str, Any] = {name: getattr(spec, name) for name in _ATTENTION_FIELDS + _EXTRA_FIELDS[cls]}
    kwargs["dtype"] = _torch_dtype(spec.dtype)
    if not isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        kwargs["head_size_v"] = spec.value_head_size
    return target(**kwargs)


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
                mamba_type=str(getattr(spec.mamba_type, "value", spec.mamba_type)),
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
# The kv_connector name vLLM's config takes for each short name.
_KV_CONNECTOR_CLASS = {
    "moriio": "MoRIIOConnector",
    "nixl": "NixlConnector",
    "nixl-push": "NixlConnector",
    "mooncake": "MooncakeConnector",
}


def build_vllm_config(
    connector: str,
    *,
    role: str,
    block_size: int,
    mode: TransferMode = TransferMode.READ,
    num_lookahead_tokens: int = 0,
) -> Any:
    """vLLM's ``VllmConfig`` for one connector and role, built by vLLM's own constructors, no model (HMA-1)."""
    config = import_vllm("vllm.config")
    extra: dict[str, Any] = {}
    if connector == "moriio":
        extra = {"handshake_port": 0, "notify_port": 0}
        if mode is TransferMode.READ:
            extra["read_mode"] = True
    if connector == "nixl-push":
        extra["push_mode"] = True
    vllm_config = config.VllmConfig(
        kv_transfer_config=config.KVTransferConfig(
            kv_connector=_KV_CONNECTOR_CLASS[connector], kv_role=role, kv_connector_extra_config=extra
        ),
        cache_config=config.CacheConfig(block_size=block_size),
        scheduler_config=config.SchedulerConfig(
            max_model_len=_MAX_MODEL_LEN, max_num_batched_tokens=8192, is_encoder_decoder=False
        ),
    )
    if num_lookahead_tokens:
        # vLLM derives the lookahead from a speculative config, which needs a draft model; the
        # block logic reads only this number, so a subclass answers it and changes nothing else.
        base = type(vllm_config)
        vllm_config.__class__ = _lookahead_class(base, num_lookahead_tokens)
    return vllm_config


_LOOKAHEAD_CLASSES: dict[tuple[type, int], type] = {}


def _lookahead_class(base: type, lookahead: int) -> type:
    key = (base, lookahead)
    if key not in _LOOKAHEAD_CLASSES:
        _LOOKAHEAD_CLASSES[key] = type(base.__name__, (base,), {"num_lookahead_tokens": property(lambda _: lookahead)})
    return _LOOKAHEAD_CLASSES[key]


def _scheduler_class(connector: str) -> Any:
    base = "vllm.distributed.kv_transfer.kv_connector.v1."
    if connector == "moriio":
        return import_vllm(base + "moriio.moriio_connector").MoRIIOConnectorScheduler
    if connector == "nixl":
        return import_vllm(base + "nixl.pull_scheduler").NixlPullConnectorScheduler
    if connector == "nixl-push":
        return import_vllm(base + "nixl.push_scheduler").NixlPushConnectorScheduler
    if connector == "mooncake":
        return import_vllm(base + "mooncake.mooncake_connector").MooncakeConnectorScheduler
    raise ConfigError(f"vLLM connector: expected one of {sorted(CONNECTORS)}, got {connector!r}")


def _smallest_block_size(config: KVCacheConfig) -> int:
    return min(g.kv_cache_spec.block_size for g in config.kv_cache_groups)


def build_scheduler(
    connector: str,
    config: KVCacheConfig,
    *,
    role: str,
    mode: TransferMode = TransferMode.READ,
    num_lookahead_tokens: int = 0,
    engine_id: str = "kvspec",
) -> Any:
    """vLLM's connector scheduler for ``config``, by its own ``__init__``; refusal: UnsupportedHybridError (ADM-1)."""
    cls = _scheduler_class(connector)
    vllm_config = build_vllm_config(
        connector,
        role=role,
        block_size=_smallest_block_size(config),
        mode=mode,
        num_lookahead_tokens=num_lookahead_tokens,
    )
    try:
        return cls(vllm_config, engine_id, to_vllm_kv_cache_config(config))
    except Exception as exc:  # vLLM refuses with NotImplementedError, ValueError, MoRIIOError, ...
        raise UnsupportedHybridError(
            f"vLLM {connector} refuses this config (ADM-1): {type(exc).__name__}: {exc}"
        ) from exc


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
    """MoRI-IO READ: per group, ``MoRIIOConnectorScheduler._align_read_blocks`` on the clipped lists (ALIGN-1)."""
    local_out: list[list[int]] = []
    remote_out: list[list[int]] = []
    if len(producer) != len(consumer):
        raise GroupCountError(f"vLLM moriio: producer has {len(producer)} groups, consumer {len(consumer)} (ALIGN-1)")
    for local, remote in zip(consumer, producer, strict=True):
        try:
            aligned_local, aligned_remote = scheduler._align_read_blocks(
                list(local), list(remote), scheduler._max_decode_tail_blocks
            )
        except ValueError as exc:
            raise _vllm_error("moriio", exc, "MoRIIOConnectorScheduler._align_read_blocks") from exc
        local_out.append(list(aligned_local))
        remote_out.append(list(aligned_remote))
    return remote_out, local_out


def pair_nixl(producer: Sequence[Sequence[int]], consumer: Sequence[Sequence[int]], *, connector: str) -> RawPairs:
    """NIXL: the worker's ``_apply_prefix_caching`` (decode list, prefill list), logical ids (ALIGN-1).

    The method reads only ``_has_mamba`` from its worker; a namespace carrying
    that attribute stands in for the worker, whose constructor needs a device.
    """
    worker = import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker").NixlBaseConnectorWorker
    stand_in = types.SimpleNamespace(_has_mamba=False)
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


# --------------------------------------------------------------------------- the Connector seam


@attrs.define
class VllmConnector:
    """A ``kvspec_conformance.Connector`` whose admission, clipping and pairing are vLLM's own code.

    ``name`` is one of :data:`CONNECTORS`; :func:`make_connector` returns the
    subclass named for it (``NixlConnector``, ...), which a reproducer can
    build with no argument. Admission builds the connector's
    consumer-side scheduler with vLLM's constructor (MoRI-IO in the suite's
    mode); clipping calls its ``get_exchange_clipped_blocks`` (Mooncake:
    ``get_sw_clipped_blocks``); pairing calls the method named in
    :data:`CONNECTORS`. vLLM checks no window coverage before it pairs, so
    neither does this adapter. The handshake check and the byte plan are
    kvspec's reference (vLLM's live in its workers, which need a device).
    """

    name: str
    _schedulers: dict[tuple[KVCacheConfig, TransferMode], Any] = attrs.field(factory=dict, repr=False)
    _mode: TransferMode = attrs.field(default=TransferMode.READ, repr=False)

    def scheduler(self, config: KVCacheConfig, mode: TransferMode | None = None) -> Any:
        """vLLM's consumer-side scheduler for ``config`` (cached) (ADM-1)."""
        key = (config, mode or self._mode)
        if key not in self._schedulers:
            self._schedulers[key] = build_scheduler(self.name, config, role="kv_consumer", mode=key[1])
        return self._schedulers[key]

    def check_admission(self, config: KVCacheConfig, mode: TransferMode) -> None:
        """vLLM's scheduler constructor decides; a refusal is :class:`UnsupportedHybridError` (ADM-1, ADM-2)."""
        # Only MoRI-IO has a mode flag; NIXL and Mooncake choose pull or push by connector class.
        self._mode = TransferMode(mode) if self.name == "moriio" else TransferMode.READ
        self.scheduler(config, self._mode)

    def check_peer(self, producer: Any, consumer: Any) -> None:
        """kvspec's ``check_compatibility``: vLLM's handshake validation lives in its workers (HS-1)."""
        check_compatibility(producer=producer, consumer=consumer)

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        """vLLM's own clipping of one side's list (CLIP-1)."""
        scheduler = self.scheduler(config)
        clip: Callable[[Any], Any] = (
            scheduler.get_sw_clipped_blocks if self.name == "mooncake" else scheduler.get_exchange_clipped_blocks
        )
        try:
            clipped = clip(_as_lists(block_ids))
        except (AssertionError, ValueError) as exc:
            raise GroupCountError(f"vLLM {self.name} refuses to clip (CLIP-1): {exc}") from exc
        return BlockIds(_as_lists(clipped))

    def pair_block_ids(
        self,
        config: KVCacheConfig,
        *,
        num_tokens: int,
        prefix_hit_tokens: int,
        producer_block_ids: BlockIds,
        consumer_block_ids: BlockIds,
        recomputed_tokens: int = 0,
        producer_block_ends: tuple[int, ...] | None = None,
        consumer_block_ends: tuple[int, ...] | None = None,
    ) -> BlockPairsLike:
        """vLLM's own pairing of the clipped lists; no WIN-1 check, as in vLLM (ALIGN-1, NULL-1).

        vLLM's lists say nothing of where they end, so the protocol 1.1
        arguments (``recomputed_tokens``, the block ends) are accepted and, as
        vLLM would, not used.
        """
        if len(consumer_block_ids) == 0:
            return BlockPairs(producer_block_ids=[], consumer_block_ids=[])
        if self.name == "moriio":
            raw = pair_moriio(self.scheduler(config), producer_block_ids, consumer_block_ids)
        elif self.name == "mooncake":
            raw = pair_mooncake(to_vllm_kv_cache_config(config), producer_block_ids, consumer_block_ids)
        else:
            raw = pair_nixl(producer_block_ids, consumer_block_ids, connector=self.name)
        return _pairs(raw[0], raw[1], self.name)

    def plan(
        self, *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
    ) -> TransferPlan:
        """kvspec's ``plan_transfer``: vLLM computes byte offsets in its workers (PLAN-1)."""
        return plan_transfer(producer_config=producer_config, consumer_config=consumer_config, pairs=pairs)


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
}
"""Short names (``--connector vllm:NAME``) and the vLLM code each adapter calls."""


def make_connector(name: str) -> VllmConnector:
    """The adapter for ``vllm:NAME``; checks that vLLM imports (ADM-1)."""
    if name not in CONNECTORS:
        raise ConfigError(f"vLLM connector: expected one of {sorted(CONNECTORS)}, got {name!r}")
    # Import everything now: importing vLLM takes seconds, which no scenario deadline should pay.
    import_vllm(_INTERFACE)
    import_vllm("vllm.config")
    _scheduler_class(name)
    if name == "mooncake":
        import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
    elif name != "moriio":
        import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    return _CLASSES[name]()
