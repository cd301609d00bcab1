"""SGLang under kvspec: config translation, and Connector-seam adapters that run SGLang's own code.

Nothing here imports SGLang until a function needs it; ``import kvspec`` and
``import kvspec.integrations.sglang`` work without it. The adapters
``sglang:mooncake``, ``sglang:nixl`` and ``sglang:mori`` report what SGLang
0.5.23 decides for one request:

* the producer's pages: ``SchedulerDisaggregationPrefillMixin._send_kv_chunk``
  (``disaggregation/prefill.py``), called for the last chunk on a stand-in
  scheduler; its ``_swa_payload`` closure picks the window pages, the sender
  it is given records what it would send;
* the consumer's pages: the ``_swa_payload`` closure of
  ``DecodePreallocQueue.pop_preallocated`` (``disaggregation/decode.py``),
  rebuilt from its own code object with the values it closes over, and the
  full-attention pages ``pop_preallocated`` slices (``kv_to_page_indices``);
* the pairing: each backend's own method on the two index lists, with its
  transfer call replaced by a recorder: Mooncake ``maybe_send_extra`` and
  ``send_kvcache`` (both end in ``_send_kvcache_generic``), MORI
  ``_send_swa_dsa_state`` (``_submit_batch_transfer_plan``), NIXL
  ``_send_prepared_states`` (``agent.make_prepped_xfer``);
* a state group (profile ``prebuilt``, :data:`STATE_PROFILE`): each side's one
  Mamba slot through the ``_mamba_payload`` closures of the same two methods
  (``req_index_to_mamba_index_mapping``), paired by Mooncake's
  ``_send_mamba_state`` (``_transfer_data`` recorded), NIXL's
  ``_send_prepared_states`` and MORI's ``_send_mamba_state``
  (``engine.batch_write`` recorded) (decisions 175-180 in decisions-engines.md).

kvspec re-implements none of these decisions. SGLang exchanges no clipped
lists (each side computes its window itself), so :meth:`SglangConnector.clip_block_ids`
returns the list as it is, and SGLang checks no window coverage, so neither
does the adapter (decisions 128-131 in decisions-engines.md).

Importing SGLang on a CPU-only machine needs two stand-ins, made only here
(:func:`import_sglang`), never installed on disk: ``torchvision`` (imported at
module load by ``sglang/srt/multimodal/internvl_utils.py``; PyPI's wheels are
CUDA builds that fail with CPU torch) and AMD's ``mori`` (imported by
``disaggregation/mori/conn.py``). Both are empty modules whose attributes are
an inert placeholder class; nothing on the paths called here uses them
(docs/reference/sglang.md, "Installing on a CPU machine").
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import shlex
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvspec.core._errors import (
    BackendUnavailableError,
    BlockAlignmentError,
    ConfigError,
    IncompatiblePeerError,
    StateSlotError,
    UnsupportedHybridError,
)
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
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
from kvspec.drivers._connector import ConsumerRankPlan
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._plan import BlockPairsLike, TransferPlan, plan_transfer
from kvspec.reference._reference import BlockPairs
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.parallel import CanonicalPage
from kvspec.spec.state import STATE_KINDS, get_state_clipped_slots, get_state_group_indices, is_state_spec

__all__ = [
    "BACKENDS",
    "SGLANG_VERSION",
    "STATE_PROFILE",
    "PagePairs",
    "SglangConnector",
    "SglangPoolConfig",
    "consumer_pages",
    "cpu_setup_script",
    "from_sglang_pool_config",
    "import_sglang",
    "installed_sglang_version",
    "load_state_slot",
    "make_connector",
    "pair_pages",
    "producer_pages",
    "to_sglang_pool_config",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release the adapters and the findings page were written against."""

STATE_PROFILE = "prebuilt"
"""SGLang's state convention (the Mamba state after all N prompt tokens; decode's first step a PREBUILT batch).

``state_tokens`` is N and nothing is recomputed (STATE-1). The adapters
admit state groups under this profile and refuse a peer of another one at
the handshake (decisions 175, 177 in decisions-engines.md). The hook: :meth:`SglangConnector.state_profile`.
"""

_DISAGG = "sglang.srt.disaggregation."

# Every module the adapters call, beside each backend's own ``conn`` module: imported by
# :meth:`SglangConnector.warm_up` before any case, never inside a scenario's deadline (27 s cold).
_USED_MODULES = (
    "torch",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.common",
    _DISAGG + "prefill",
    _DISAGG + "decode",
    _DISAGG + "base.conn",
    _DISAGG + "utils",
    _DISAGG + "common.staging_buffer",
)

# --------------------------------------------------------------------------- importing SGLang on a CPU


class _InertMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Inert(metaclass=_InertMeta):
    """What a stubbed module's attributes are: any attribute of it is itself, making one raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise BackendUnavailableError("kvspec stubbed this module to import SGLang on a CPU; it cannot be used")


def _inert_attribute(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert


def _stub(names: Sequence[str]) -> None:
    for name in names:
        if name in sys.modules:
            continue
        module = types.ModuleType(name, "stand-in made by kvspec.integrations.sglang (import on a CPU)")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        module.__getattr__ = _inert_attribute  # type: ignore[method-assign]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
_MORI = ("mori", "mori.cpp", "mori.io")
_PREPARED: list[bool] = []


def _importable(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
    except Exception:  # a CUDA torchvision with CPU torch fails with RuntimeError or OSError
        return False
    return True


def _prepare() -> None:
    if _PREPARED:
        return
    if not _importable("torchvision"):
        # transformers must see no torchvision (it would load its image processors); ask it before the stand-in.
        try:
            utils = importlib.import_module("transformers.utils.import_utils")
            utils.is_torchvision_available()
        except ImportError:
            pass
        _stub(_TORCHVISION)
    if importlib.util.find_spec("mori") is None:
        _stub(_MORI)
    for name in ("sglang", "sglang.srt.disaggregation"):
        # SGLang warns about missing GPU libraries and about every length mismatch it truncates; the
        # adapter reports those itself.
        logging.getLogger(name).setLevel(logging.CRITICAL)
    _PREPARED.append(True)


def import_sglang(module: str = "sglang") -> Any:
    """Import an SGLang module for the CPU (with the stand-ins above); a clear error without SGLang (ADM-1)."""
    _prepare()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Only CUDA ... support AWQ" and the like, at import
            return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"kvspec.integrations.sglang needs SGLang {SGLANG_VERSION} (on a CPU-only machine: kvspec "
            f"sglang-setup --print | bash): cannot import {module}: {exc}"
        ) from exc


def installed_sglang_version() -> str | None:
    """The installed SGLang's version from its package metadata, or None without SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_sglang_version() -> None:
    """:class:`BackendUnavailableError` unless SGLang :data:`SGLANG_VERSION` is installed (adapters call internals)."""
    found = installed_sglang_version()
    if found != SGLANG_VERSION:
        raise BackendUnavailableError(
            f"kvspec's SGLang adapters were written for SGLang {SGLANG_VERSION}; found "
            f"{found or 'none'} (kvspec sglang-setup --print | bash)"
        )


def cpu_setup_script(python: str | None = None) -> str:
    """The shell commands that install SGLang for the CPU as kvspec tests it (``kvspec sglang-setup --print``).

    SGLang's wheel without its dependencies (they pin torch 2.14.1 and CUDA
    wheels), then only what its disaggregation code imports, each without
    dependencies: kvspec/integrations/constraints/sglang-cpu.txt. ``python``
    is the interpreter whose pip installs: by default the one running kvspec
    (``sys.executable``), not the first ``python`` on ``PATH``.
    """
    from importlib import resources

    python = shlex.quote(sys.executable) if python is None else python

    listed = (
        resources.files("kvspec.integrations").joinpath("constraints", "sglang-cpu.txt").read_text(encoding="utf-8")
    )
    needs = " ".join(line.strip() for line in listed.splitlines() if line.strip() and not line.startswith("#"))
    return (
        "\n".join(
            [
                "# SGLang for the CPU, as kvspec's CI installs it (docs/explanation/sglang-findings.md)",
                "set -euo pipefail",
                f"{python} -m pip install --no-deps {needs}",
                f'{python} -c \'import kvspec.integrations.sglang as s; s.import_sglang("{_DISAGG}mooncake.conn"); '
                "print(s.installed_sglang_version())'",
            ]
        )
        + "\n"
    )


# --------------------------------------------------------------------------- config translation


@attrs.frozen
class SglangPoolConfig:
    """The part of SGLang's model and pool configuration the transfer depends on.

    ``page_size`` is ``--page-size``; ``sliding_window_size`` is SGLang's
    ``Scheduler.sliding_window_size``, the Hugging Face window minus one
    (``models/gpt_oss.py``); the layer ids are the model's
    ``full_attention_layer_ids`` and ``swa_attention_layer_ids`` as
    ``SWAKVPool`` takes them; ``head_num``, ``head_dim`` and ``dtype`` as
    ``MHATokenToKVPool`` takes them; ``num_pages`` per pool. The Mamba
    pool (``HybridReqToTokenPool``): ``mamba_layer_ids``, one state layout
    (``mamba_state_shapes``, ``mamba_state_dtypes``: conv then SSM, as
    ``Mamba2CacheParams`` gives them) and ``mamba_type``; one slot per
    request, so no page size.
    """

    page_size: int
    full_attention_layer_ids: tuple[int, ...]
    swa_attention_layer_ids: tuple[int, ...] = ()
    sliding_window_size: int | None = None
    head_num: int = 1
    head_dim: int = 128
    v_head_dim: int | None = None
    dtype: str = "bfloat16"
    num_pages: int = 1024
    use_mla: bool = False
    mamba_layer_ids: tuple[int, ...] = ()
    mamba_state_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_state_dtypes: tuple[str, ...] = ()
    mamba_type: str = "mamba2"


def to_sglang_pool_config(config: KVCacheConfig) -> SglangPoolConfig:
    """SGLang's pool configuration for a kvspec config, or :class:`UnsupportedHybridError` naming what it lacks (ADM-1).

    SGLang has one page size, one sliding window, one full and one SWA pool:
    a config needing more is a modelling difference, refused (decision 132 in decisions-engines.md).
    """
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    if not specs:
        raise ConfigError("to_sglang_pool_config: the config has no groups")
    for index, spec in enumerate(specs):
        if type(spec) not in _ADMITTED:
            raise UnsupportedHybridError(
                f"kv_cache_groups[{index}]: SGLang's adapters model {type(spec).__name__} not "
                f"(admitted: {', '.join(c.__name__ for c in _ADMITTED)}) (ADM-1)"
            )
    states = [s for s in specs if isinstance(s, MambaSpec)]
    unknown = sorted({s.mamba_type for s in states} - STATE_KINDS)
    if unknown:
        raise UnsupportedHybridError(f"state kinds {unknown}: the state rules cover {sorted(STATE_KINDS)} (ADM-1)")
    # SGLang's one Mamba pool holds every state layer with one cache layout (Mamba2CacheParams).
    layouts = {(s.shapes, s.dtypes, s.mamba_type) for s in states}
    if len(layouts) > 1:
        raise UnsupportedHybridError(
            f"SGLang has one Mamba pool of one state layout; the state groups have {len(layouts)} (ADM-1)"
        )
    # A state slot has no page size (STATE-2): the token pools' page size is the attention groups'.
    specs = [s for s in specs if not isinstance(s, MambaSpec)] or list[KVCacheSpec](states[:1])
    sizes = sorted({s.block_size for s in specs})
    if len(sizes) > 1:
        raise UnsupportedHybridError(f"SGLang has one page size; the groups' block_size values are {sizes} (ADM-1)")
    windows = sorted({s.sliding_window for s in specs if isinstance(s, (SlidingWindowSpec, SlidingWindowMLASpec))})
    if len(windows) > 1:
        raise UnsupportedHybridError(f"SGLang has one sliding window; the groups' windows are {windows} (ADM-1)")
    mla = sorted({isinstance(s, (MLAAttentionSpec, SlidingWindowMLASpec)) for s in specs})
    if len(mla) > 1:
        raise UnsupportedHybridError("SGLang's pools are all MLA or all MHA; this config mixes them (ADM-1)")
    full: list[int] = []
    swa: list[int] = []
    state: list[int] = []
    layer = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        ids = range(layer, layer + len(group.layer_names))
        layer += len(group.layer_names)
        (state if isinstance(spec, MambaSpec) else swa if _is_window(spec) else full).extend(ids)
    first: Any = specs[0]  # an attention spec, or the state spec of a model without attention
    heads = (
        {}
        if isinstance(first, MambaSpec)
        else {
            "head_num": getattr(first, "num_kv_heads", 1),
            "head_dim": getattr(first, "head_size", 128),
            "v_head_dim": None if first.value_head_size == getattr(first, "head_size", None) else first.value_head_size,
            "dtype": first.dtype.name,
        }
    )
    return SglangPoolConfig(
        page_size=sizes[0],
        full_attention_layer_ids=tuple(full),
        swa_attention_layer_ids=tuple(swa),
        sliding_window_size=windows[0] - 1 if windows else None,
        **heads,
        num_pages=config.num_blocks,
        use_mla=mla == [True],
        mamba_layer_ids=tuple(state),
        mamba_state_shapes=states[0].shapes if states else (),
        mamba_state_dtypes=tuple(d.name for d in states[0].dtypes) if states else (),
        mamba_type=states[0].mamba_type if states else "mamba2",
    )


def from_sglang_pool_config(pool: SglangPoolConfig) -> KVCacheConfig:
    """kvspec's model of SGLang's pools: a full group, with a window an SWA group of window + 1 (SW-1), a state group.

    SGLang's ``sliding_window_size`` excludes the current token; kvspec's
    window, like Hugging Face's, includes it (decision 128 in decisions-engines.md).
    """
    if pool.page_size < 1:
        raise ConfigError(f"SglangPoolConfig.page_size: expected a positive integer, got {pool.page_size}")
    if pool.swa_attention_layer_ids and (pool.sliding_window_size is None or pool.sliding_window_size < 0):
        raise ConfigError(
            "SglangPoolConfig.sliding_window_size: expected a non-negative integer with SWA layers, "
            f"got {pool.sliding_window_size!r}"
        )
    dtype = DType.from_name(pool.dtype)
    groups: list[KVCacheGroupSpec] = []
    kinds: list[tuple[tuple[int, ...], KVCacheSpec]] = []
    if pool.full_attention_layer_ids:
        full: KVCacheSpec = (
            MLAAttentionSpec(block_size=pool.page_size, num_kv_heads=1, head_size=pool.head_dim, dtype=dtype)
            if pool.use_mla
            else FullAttentionSpec(
                block_size=pool.page_size,
                num_kv_heads=pool.head_num,
                head_size=pool.head_dim,
                dtype=dtype,
                head_size_v=pool.v_head_dim,
            )
        )
        kinds.append((pool.full_attention_layer_ids, full))
    if pool.swa_attention_layer_ids:
        window = int(pool.sliding_window_size or 0) + 1
        swa: KVCacheSpec = (
            SlidingWindowMLASpec(
                block_size=pool.page_size, num_kv_heads=1, head_size=pool.head_dim, dtype=dtype, sliding_window=window
            )
            if pool.use_mla
            else SlidingWindowSpec(
                block_size=pool.page_size,
                num_kv_heads=pool.head_num,
                head_size=pool.head_dim,
                dtype=dtype,
                sliding_window=window,
                head_size_v=pool.v_head_dim,
            )
        )
        kinds.append((pool.swa_attention_layer_ids, swa))
    if pool.mamba_layer_ids:
        if not pool.mamba_state_shapes:
            raise ConfigError(
                "SglangPoolConfig.mamba_state_shapes: expected the state shapes with Mamba layers, got ()"
            )
        state = MambaSpec(
            block_size=pool.page_size,
            shapes=pool.mamba_state_shapes,
            dtypes=tuple(DType.from_name(d) for d in pool.mamba_state_dtypes),
            mamba_type=pool.mamba_type,
        )
        kinds.append((pool.mamba_layer_ids, state))
    tensors = []
    for layers, spec in kinds:
        names = [f"model.layers.{i}" for i in layers]
        groups.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
        page = spec.page_size_bytes
        tensors += [
            KVCacheTensor(size=page * pool.num_pages, layers=[n], layer_stride=page, block_stride=page) for n in names
        ]
    return KVCacheConfig(num_blocks=pool.num_pages, kv_cache_tensors=tensors, kv_cache_groups=groups)


_ADMITTED: tuple[type[KVCacheSpec], ...] = (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SlidingWindowMLASpec,
    MambaSpec,
)


# --------------------------------------------------------------------------- SGLang's index building


def _is_window(spec: KVCacheSpec) -> bool:
    return isinstance(spec, (SlidingWindowSpec, SlidingWindowMLASpec))


def _rebind(function: Any, **names: object) -> Any:
    """``function`` with some of its module's globals replaced (SGLang's runtime context is never published here)."""
    code = function.__code__
    namespace = {**function.__globals__, **names}
    return types.FunctionType(code, namespace, function.__name__, function.__defaults__, function.__closure__)


_MEMORY = types.SimpleNamespace(enable_unified_memory=False)


def _row(block_ids: Sequence[int], *, first_block: int, page_size: int, num_tokens: int) -> Any:
    """A ``req_to_token`` row: token t at page ``block_ids[t // B - first_block]`` (null where the list has none)."""
    torch = import_sglang("torch")
    length = max(num_tokens, (first_block + len(block_ids)) * page_size, 1)
    pages = [NULL_BLOCK_ID] * first_block + [int(b) for b in block_ids]
    pages += [NULL_BLOCK_ID] * (-(-length // page_size) - len(pages))
    page = torch.tensor(pages, dtype=torch.int64).repeat_interleave(page_size)[:length]
    offset = torch.arange(length, dtype=torch.int64) % page_size
    return (page * page_size + offset).reshape(1, -1)


def load_state_slot(spec: KVCacheSpec, block_ids: Sequence[int], *, group: int = 0) -> list[int]:
    """The one Mamba slot SGLang's pool holds for a state group's list: STATE-2's kept slot (decision 176 in
    decisions-engines.md).

    SGLang allocates one slot per request (``HybridReqToTokenPool.alloc``)
    and keeps it in ``req_index_to_mamba_index_mapping``; kvspec's tables are
    vLLM's shape (null placeholders, the state's slot, scratch slots). Loading
    a table into SGLang's pool keeps the slot STATE-2 keeps; a null kept slot
    is :class:`StateSlotError` (STATE-2), and so is a list with no slot, which
    SGLang's pool cannot hold (STATE-3).
    """
    if not isinstance(spec, MambaSpec):
        raise ConfigError(f"group {group}: {type(spec).__name__} is not a state group; expected MambaSpec")
    kept = list(get_state_clipped_slots(spec, block_ids, group=group))
    if not kept:
        raise StateSlotError(
            f"group {group} ({spec.mamba_type}): the list holds no state slot; SGLang holds exactly one Mamba slot "
            "per request (STATE-3)"
        )
    return kept


def _req_to_token_pool(table: Any, slots: Sequence[int] | None) -> Any:
    """SGLang's request pool for request row 0: its token row and, for a state group, its one Mamba slot.

    ``translate_mamba_indices`` is SGLang's own ``HybridReqToTokenPool``
    method (the identity for a static pool), bound to the stand-in.
    """
    if slots is None:
        return types.SimpleNamespace(req_to_token=table)
    torch = import_sglang("torch")
    memory_pool = import_sglang("sglang.srt.mem_cache.memory_pool")
    pool = types.SimpleNamespace(
        req_to_token=table, req_index_to_mamba_index_mapping=torch.tensor(list(slots), dtype=torch.int32)
    )
    pool.translate_mamba_indices = types.MethodType(memory_pool.HybridReqToTokenPool.translate_mamba_indices, pool)
    return pool


def _sgl_window(spec: KVCacheSpec) -> int | None:
    return spec.sliding_window - 1 if isinstance(spec, (SlidingWindowSpec, SlidingWindowMLASpec)) else None


def producer_pages(
    spec: KVCacheSpec, block_ids: Sequence[int], *, first_block: int, num_tokens: int, prefix_tokens: int
) -> list[int]:
    """The pages SGLang's prefill sends for one group: ``_send_kv_chunk`` on its last chunk (WIN-1, ALIGN-1).

    ``block_ids`` start at logical block ``first_block``; ``prefix_tokens`` is
    decode's prefix (``req.disagg_decode_prefix_len``). A window group reads
    the SWA state payload, a state group the Mamba payload (its one slot,
    :func:`load_state_slot`, through ``req_index_to_mamba_index_mapping``;
    STATE-2), any other group the KV pages the sender is given.
    """
    prefill = import_sglang(_DISAGG + "prefill")
    state_type = import_sglang(_DISAGG + "base.conn").StateType
    window = _sgl_window(spec)
    state = is_state_spec(spec)
    if state:
        block_ids = load_state_slot(spec, block_ids)
    sent: list[tuple[Any, Any]] = []
    # A state group has no token pages: its row reads the null page, its slot sits in the Mamba mapping.
    table = _row(
        [] if state else block_ids,
        first_block=0 if state else first_block,
        page_size=spec.block_size,
        num_tokens=num_tokens,
    )
    sender = types.SimpleNamespace(
        supports_host_tensor_indices=False,
        get_max_transfer_tokens=lambda: None,
        should_send_kv_chunk=lambda count, last: True,
        send=lambda pages, state, num_kv_tokens=None: sent.append((pages, state)),
    )
    state_types = [state_type.SWA] if window is not None else [state_type.MAMBA] if state else []
    identity: Callable[[Any], Any] = lambda indices: indices  # noqa: E731  # one pool per group: no translation
    scheduler = types.SimpleNamespace(
        token_to_kv_pool_allocator=types.SimpleNamespace(
            page_size=spec.block_size,
            get_kvcache=lambda: types.SimpleNamespace(request_window=None),
            translate_swa_indices_for_transfer=identity,
            translate_kv_indices_for_transfer=identity,
        ),
        sliding_window_size=window,
        req_to_token_pool=_req_to_token_pool(table, block_ids if state else None),
        enable_staging=False,
        disagg_metadata_buffers=types.SimpleNamespace(set_buf=lambda req: None),
        disagg_prefill_bootstrap_queue=types.SimpleNamespace(
            kv_manager=types.SimpleNamespace(kv_args=types.SimpleNamespace(state_types=state_types))
        ),
        disagg_prefill_pending_chunk_rids=set(),
    )
    req = types.SimpleNamespace(
        rid="kvspec",
        start_send_idx=prefix_tokens,
        origin_input_ids=[0] * num_tokens,
        extend_end=num_tokens,
        disagg_decode_prefix_len=prefix_tokens,
        kv=types.SimpleNamespace(req_pool_idx=0),
        disagg_kv_sender=sender,
    )
    prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk(scheduler, req, last_chunk=True)
    if not sent:
        return []
    pages, payloads = sent[-1]
    chosen = payloads[0] if (window is not None or state) and payloads else pages
    return [int(p) for p in chosen]


def _decode_closure(name: str) -> Any:
    decode = import_sglang(_DISAGG + "decode")
    outer = decode.DecodePreallocQueue.pop_preallocated.__code__
    for const in outer.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == name:
            return decode, const
    raise BackendUnavailableError(
        f"SGLang {installed_sglang_version()}: DecodePreallocQueue.pop_preallocated has no closure {name}; "
        f"the adapter was written for {SGLANG_VERSION}"
    )


def consumer_pages(
    spec: KVCacheSpec, block_ids: Sequence[int], *, first_block: int, num_tokens: int, prefix_tokens: int
) -> list[int]:
    """The pages SGLang's decode pre-allocation offers for one group (WIN-1, ALIGN-1).

    A window group runs ``pop_preallocated``'s own ``_swa_payload`` closure,
    a state group its ``_mamba_payload`` closure (the one slot,
    :func:`load_state_slot`; STATE-2); any other group the suffix
    ``pop_preallocated`` slices, ``req_to_token[total_prefix_len:origin_input_len]``
    through SGLang's ``kv_to_page_indices``.
    """
    state = is_state_spec(spec)
    slots = load_state_slot(spec, block_ids) if state else None
    table = _row(
        [] if state else block_ids,
        first_block=0 if state else first_block,
        page_size=spec.block_size,
        num_tokens=num_tokens,
    )
    window = _sgl_window(spec)
    common = import_sglang("sglang.srt.mem_cache.common")
    if window is None and not state:
        return [int(p) for p in common.kv_to_page_indices(table[0, prefix_tokens:num_tokens], spec.block_size)]
    decode, code = _decode_closure("_mamba_payload" if state else "_swa_payload")
    queue = types.SimpleNamespace(
        scheduler=types.SimpleNamespace(sliding_window_size=window),
        req_to_token_pool=_req_to_token_pool(table, slots),
        token_to_kv_pool_allocator=types.SimpleNamespace(translate_swa_indices_for_transfer=lambda indices: indices),
    )
    values = {
        "self": queue,
        "total_prefix_len": prefix_tokens,
        "seq_len": num_tokens,
        "page_size": spec.block_size,
        "decode_req": types.SimpleNamespace(req=types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=0))),
    }
    missing = [n for n in code.co_freevars if n not in values]
    if missing:
        raise BackendUnavailableError(f"SGLang's decode {code.co_name} closes over {missing}, unknown to the adapter")
    closure = tuple(types.CellType(values[n]) for n in code.co_freevars)
    payload = types.FunctionType(code, decode.__dict__, code.co_name, None, closure)
    return [int(p) for p in payload()]  # a state group's payload: one slot


# --------------------------------------------------------------------------- each backend's pairing

PagePairs = tuple[list[int], list[int]]
"""(producer pages, consumer pages) in the order a backend would copy them: the i-th of one to the i-th of the other."""


def _mooncake(producer: Sequence[int], consumer: Sequence[int], *, window: bool, state: bool = False) -> PagePairs:
    module = import_sglang(_DISAGG + "mooncake.conn")
    manager = module.MooncakeKVManager
    state_type = import_sglang(_DISAGG + "base.conn").StateType
    copied: list[tuple[list[int], list[int]]] = []

    def record(**kwargs: Any) -> int:
        copied.append(([int(p) for p in kwargs["prefill_data_indices"]], [int(d) for d in kwargs["dst_data_indices"]]))
        return 0

    def transfer(session_id: str, blocks: Sequence[tuple[int, int, int]]) -> int:
        # Mamba's copies: (src_addr, dst_addr, length) with base 0 and item length 1, so each address is the slot.
        copied.append(([int(b[0]) for b in blocks], [int(b[1]) for b in blocks]))
        return 0

    stand_in = types.SimpleNamespace(
        kv_args=types.SimpleNamespace(
            state_types=[state_type.MAMBA if state else state_type.SWA],
            state_data_ptrs=[[0]],
            state_item_lens=[[1]],
            state_dim_per_tensor=[],
            state_layer_ids=[],
            kv_data_ptrs=[0],
            kv_item_lens=[1],
            kv_layer_ids=[],
        ),
        attn_tp_size=1,
        state_tp_size=1,
        pp_size=1,
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        _send_kvcache_generic=record,
        _transfer_data=transfer,
        _validate_envelope_kv_layout=lambda *args: None,
        request_status={},
    )
    stand_in._is_generic_kvcache_state_type = types.MethodType(manager._is_generic_kvcache_state_type, stand_in)
    stand_in._requires_exact_state_index_match = types.MethodType(manager._requires_exact_state_index_match, stand_in)
    stand_in._send_mamba_state = types.MethodType(manager._send_mamba_state, stand_in)
    src = module.np.array(list(producer), dtype=module.np.int32)
    dst = module.np.array(list(consumer), dtype=module.np.int32)
    if state:
        # The decode peer as registered: one state buffer of item length 1, the same TP size (no re-slicing).
        peer = types.SimpleNamespace(
            dst_state_data_ptrs=[[0]],
            dst_state_item_lens=[[1]],
            dst_state_dim_per_tensor=[[]],
            dst_state_layer_ids=[[]],
            dst_attn_tp_size=1,
            dst_tp_rank=0,
        )
        request = types.SimpleNamespace(dst_state_indices=[dst], mooncake_session_id="kvspec", room=0)
        _rebind(manager.maybe_send_extra, get_memory=lambda: _MEMORY)(stand_in, request, [src], None, peer)
    elif window:
        request = types.SimpleNamespace(dst_state_indices=[dst], mooncake_session_id="kvspec", room=0)
        _rebind(manager.maybe_send_extra, get_memory=lambda: _MEMORY)(stand_in, request, [src], None, None)
    else:
        _rebind(manager.send_kvcache, get_memory=lambda: _MEMORY)(stand_in, "kvspec", src, [0], dst, None)
    if not copied:
        return [], []
    return copied[-1]


def _mori(producer: Sequence[int], consumer: Sequence[int], *, window: bool, state: bool = False) -> PagePairs:
    module = import_sglang(_DISAGG + "mori.conn")
    if state:
        return _mori_state(module, producer, consumer)
    plans: list[Any] = []

    def submit(src_desc: object, dst_desc: object, plan: Any) -> list[Any]:
        plans.append(plan)
        return []

    stand_in = types.SimpleNamespace(
        is_mla_backend=False,
        attn_tp_size=1,
        state_tp_size=1,
        pp_size=1,
        _build_contiguous_transfer_plan=lambda plan, item_len: plan.materialize(item_len),
        _submit_batch_transfer_plan=submit,
    )
    peer = types.SimpleNamespace(decode_tp_size=1)
    src = module.np.array(list(producer), dtype=module.np.int32)
    dst = module.np.array(list(consumer), dtype=module.np.int32)
    # Window pages go through _send_swa_dsa_state, which decides what a length mismatch does; MORI's full-page
    # path lives in its transfer worker, so full pages are paired by the same method (decision 130 in
    # decisions-engines.md).
    module.MoriKVManager._send_swa_dsa_state(stand_in, peer, src, dst, [None], [1], [None], [1], "swa", [], [])
    out_p: list[int] = []
    out_c: list[int] = []
    for plan in plans:
        for local, remote, size in zip(plan.local_offsets, plan.remote_offsets, plan.sizes, strict=True):
            out_p += range(local, local + size)
            out_c += range(remote, remote + size)
    return out_p, out_c


def _mori_state(module: Any, producer: Sequence[int], consumer: Sequence[int]) -> PagePairs:
    """MORI's ``_send_mamba_state`` with its engine's ``batch_write`` recorded: offsets are slots (item length 1)."""
    written: list[tuple[int, int]] = []

    def batch_write(src: object, src_offsets: Any, dst: object, dst_offsets: Any, sizes: Any, uids: Any) -> list[Any]:
        written.extend((int(s[0]), int(d[0])) for s, d in zip(src_offsets, dst_offsets, strict=True))
        return []

    stand_in = types.SimpleNamespace(
        state_tp_size=1,
        pp_size=1,
        kv_args=types.SimpleNamespace(engine_rank=0),
        engine=types.SimpleNamespace(allocate_transfer_uid=lambda: 0, batch_write=batch_write),
        _record_submitted_statuses=lambda statuses: None,
    )
    peer = types.SimpleNamespace(decode_tp_size=1, decode_tp_rank=0)
    src = module.np.array(list(producer), dtype=module.np.int32)
    dst = module.np.array(list(consumer), dtype=module.np.int32)
    module.MoriKVManager._send_mamba_state(
        stand_in, peer, src, dst, [None], [None], [1], [1], [], [], [None], [1], [], []
    )
    return [p for p, _ in written], [c for _, c in written]


def _nixl(producer: Sequence[int], consumer: Sequence[int], *, window: bool, state: bool = False) -> PagePairs:
    module = import_sglang(_DISAGG + "nixl.conn")
    state_type = import_sglang(_DISAGG + "base.conn").StateType
    made: list[tuple[Any, Any]] = []
    capacity = max([*producer, *consumer, 0]) + 1

    def make_prepped_xfer(op: str, src_handle: object, src: Any, dst_handle: object, dst: Any) -> str:
        made.append((src, dst))
        return "handle"

    agent = types.SimpleNamespace(make_prepped_xfer=make_prepped_xfer)
    stand_in = types.SimpleNamespace(
        kv_args=types.SimpleNamespace(state_types=[state_type.MAMBA if state else state_type.SWA]),
        agent=agent,
        _post_xfer=lambda handle, message: None,
    )
    zero = module.np.zeros(1, dtype=module.np.int32)
    component = module._PreparedStateComponent(
        src_offsets=zero, dst_offsets=zero, src_capacity=capacity, dst_capacity=capacity
    )
    plan = module._PreparedStatePlan(src_handle="src", dst_handle="dst", components={0: component})
    steps = module.NixlKVManager._send_prepared_states(
        stand_in, plan=plan, prefill_state_indices=[list(producer)], dst_state_indices=[list(consumer)]
    )
    for _ in steps:
        pass
    if not made:
        return [], []
    return [int(p) for p in made[-1][0]], [int(d) for d in made[-1][1]]


BACKENDS: dict[str, Callable[..., PagePairs]] = {"mooncake": _mooncake, "mori": _mori, "nixl": _nixl}
"""Backend name -> its pairing, each SGLang's own method on a stand-in manager."""


def pair_pages(
    backend: str, producer: Sequence[int], consumer: Sequence[int], *, window: bool = True, state: bool = False
) -> PagePairs:
    """The pages ``backend`` would copy for two index lists: SGLang's own pairing (ALIGN-1, STATE-3).

    With ``state`` the lists are Mamba slot indices and the backend's Mamba
    path pairs them: Mooncake ``maybe_send_extra`` into ``_send_mamba_state``
    (``_transfer_data`` recorded), NIXL ``_send_prepared_states`` for a MAMBA
    component, MORI ``_send_mamba_state`` (``batch_write`` recorded). A
    refusal by SGLang (NIXL on any length mismatch, MORI on no overlap, any
    backend on more than one Mamba slot) becomes :class:`BlockAlignmentError`
    with SGLang's message kept; for state, :class:`StateSlotError`.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"SGLang backend {backend!r}: expected one of {sorted(BACKENDS)}")
    try:
        if state:
            return BACKENDS[backend](producer, consumer, window=False, state=True)
        return BACKENDS[backend](producer, consumer, window=window)
    except (AssertionError, RuntimeError, ValueError) as exc:
        error = StateSlotError if state else BlockAlignmentError
        rule = "STATE-3" if state else "ALIGN-1"
        raise error(f"SGLang {backend} refuses to pair ({rule}): {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- the Connector seam


def _placed(ids: Sequence[int], end: int | None, listed_blocks: int) -> int:
    """The logical block a list's first entry stands for: lists end at the request's last block, or at ``end``."""
    return (listed_blocks if end is None else end) - len(ids)


@attrs.define
class SglangConnector:
    """A ``kvspec_conformance.Connector`` whose window and index selection and pairing are SGLang 0.5.23's code.

    ``backend`` is ``mooncake``, ``nixl`` or ``mori``. Per group, the
    producer's pages come from ``_send_kv_chunk``, the consumer's from
    ``pop_preallocated``'s index building, and the pairs from the backend's
    own method (:func:`pair_pages`). SGLang has no clip step and no window
    coverage check; the adapter adds neither. The handshake check and the
    byte plan are kvspec's reference (SGLang's live in its transfer workers).
    """

    backend: str

    def __attrs_post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"sglang:{self.backend}: expected one of {', '.join('sglang:' + b for b in BACKENDS)}")

    def kvspec_replay(self) -> tuple[str, str]:
        """The import lines and the expression that rebuild this connector, for reproducers."""
        return "from kvspec.integrations.sglang import SglangConnector\n", f"SglangConnector({self.backend!r})"

    def kvspec_tested(self) -> tuple[tuple[str, str], ...]:
        """What a report names as tested besides the backend: ``sglang:BACKEND`` and the installed SGLang."""
        return (("connector", f"sglang:{self.backend}"), ("sglang", installed_sglang_version() or "?"))

    def warm_up(self) -> None:
        """Import every SGLang module this adapter calls, so that no case's deadline pays for it (27 s cold).

        The suite calls it once before the first case (``run_suite``).
        """
        for module in (*_USED_MODULES, f"{_DISAGG}{self.backend}.conn"):
            import_sglang(module)

    def state_profile(self, config: KVCacheConfig) -> str | None:
        """SGLang's state convention, :data:`STATE_PROFILE`, for a config with state groups; else None (STATE-1)."""
        return STATE_PROFILE if get_state_group_indices(config) else None

    def check_admission(self, config: KVCacheConfig, mode: TransferMode) -> None:
        """What SGLang can represent: one page size, one window, full and SWA pools (ADM-1, decision 132 in
        decisions-engines.md).

        SGLang's backends all write from prefill to decode; its block logic is
        the same whichever side kvspec says posts, so both modes are admitted.
        """
        import_sglang(_DISAGG + "prefill")
        to_sglang_pool_config(config)

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
        """SGLang's own head and state slices across TP sizes (PAR-3, PAR-4, PAR-6); Mooncake's transfer path.

        ``compute_head_slice_params``, ``compute_mamba_state_slice_blocks`` and
        ``should_send_replicated_state`` are what SGLang's Mooncake backend
        calls; NIXL and MoRI build their slices elsewhere, which the adapter
        does not run (:class:`NotImplementedError`: the case is skipped).
        """
        from kvspec.integrations.sglang_parallel import plan_sglang_consumer_rank

        if self.backend != "mooncake":
            raise NotImplementedError(
                f"sglang:{self.backend} builds its TP slices in its own transfer code, which the adapter does not "
                "run (only the Mooncake backend's compute_head_slice_params / compute_mamba_state_slice_blocks path "
                "is adapted)"
            )
        return plan_sglang_consumer_rank(
            pages,
            producer_tp=producer_tp,
            consumer_tp=consumer_tp,
            consumer_rank=consumer_rank,
            consumer_dcp=consumer_dcp,
        )

    def check_peer(self, producer: Any, consumer: Any) -> None:
        """kvspec's ``check_compatibility`` (SGLang checks its peer's layout in its bootstrap threads, HS-1).

        An engine with state groups is SGLang's only under :data:`STATE_PROFILE`:
        a descriptor of another profile describes an engine these adapters do
        not model, refused naming ``state_profile`` (STATE-1, decision 177 in decisions-engines.md).
        """
        check_compatibility(producer=producer, consumer=consumer)
        profiles = [getattr(p, "value", p) for p in (producer.state_profile, consumer.state_profile)]
        if any(p is not None and p != STATE_PROFILE for p in profiles):
            field = f"state_profile (SGLang {SGLANG_VERSION}'s is {STATE_PROFILE!r}, STATE-1)"
            raise IncompatiblePeerError({field: (profiles[0], profiles[1])})

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        """The attention lists as they are; a state group's list is its one Mamba slot (CLIP-1, STATE-2).

        SGLang exchanges no clipped lists: each side selects its window itself.
        A state group's list is what SGLang's pool holds and sends for it, the
        one slot :func:`load_state_slot` loads (decision 176 in decisions-engines.md); an empty list
        stays empty, pairing refuses it.
        """
        states = set(get_state_group_indices(config)) if len(block_ids) == config.num_groups else set()
        out: list[list[int]] = []
        for index, group in enumerate(block_ids):
            spec = config.kv_cache_groups[index].kv_cache_spec if index in states else None
            out.append(load_state_slot(spec, group, group=index) if spec is not None and group else list(group))
        return BlockIds(out)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        """SGLang's own selection and pairing per group; no WIN-1 check, as in SGLang (ALIGN-1, NULL-1).

        The lists are placed by their ends (or at the request's last block),
        made into ``req_to_token`` rows with the null id where a list has no
        entry, and handed to SGLang with ``seq_len`` the tokens the lists cover
        (``num_tokens + recomputed_tokens``: SGLang ships every prompt token and
        recomputes none) and decode's prefix ``prefix_hit_tokens``. A page SGLang reads where the list has
        none shows as the null id, which NULL-1 refuses. A state group's lists
        are each loaded as the request's one Mamba slot (:func:`load_state_slot`),
        read back through SGLang's Mamba payloads and paired by the backend's
        Mamba path; SGLang sends the state on any decode prefix, so STATE-4 is
        not checked, as in SGLang (decision 178 in decisions-engines.md).
        """
        producer_block_ids, consumer_block_ids = request.producer_block_ids, request.consumer_block_ids
        producer_block_ends, consumer_block_ends = request.producer_block_ends, request.consumer_block_ends
        prefix_hit_tokens = request.prefix_hit_tokens
        if len(consumer_block_ids) == 0:
            return BlockPairs(producer_block_ids=[], consumer_block_ids=[])
        groups = config.kv_cache_groups
        if len(producer_block_ids) != len(groups) or len(consumer_block_ids) != len(groups):
            from kvspec.core._errors import GroupCountError

            raise GroupCountError(
                f"sglang:{self.backend}: {len(groups)} groups, producer has {len(producer_block_ids)}, "
                f"consumer {len(consumer_block_ids)} (ALIGN-1)"
            )
        listed = request.listed_tokens
        out_p: list[list[int]] = []
        out_c: list[list[int]] = []
        for index, group in enumerate(groups):
            spec = group.kv_cache_spec
            p_ids, c_ids = list(producer_block_ids[index]), list(consumer_block_ids[index])
            if is_state_spec(spec):
                # One slot per side through SGLang's Mamba payloads, paired by the backend's Mamba path (STATE-3).
                keywords = {"first_block": 0, "num_tokens": listed, "prefix_tokens": prefix_hit_tokens}
                p_slot = load_state_slot(spec, p_ids, group=index)
                c_slot = load_state_slot(spec, c_ids, group=index)
                src = producer_pages(spec, p_slot, **keywords)
                dst = consumer_pages(spec, c_slot, **keywords)
                paired_p, paired_c = pair_pages(self.backend, src, dst, state=True)
                out_p.append(paired_p)
                out_c.append(paired_c)
                continue
            blocks = -(-listed // spec.block_size)
            p_first = _placed(p_ids, None if producer_block_ends is None else producer_block_ends[index], blocks)
            c_first = _placed(c_ids, None if consumer_block_ends is None else consumer_block_ends[index], blocks)
            if p_first < 0 or c_first < 0:
                raise BlockAlignmentError(
                    f"group {index}: a list of {max(len(p_ids), len(c_ids))} blocks cannot end at block "
                    f"{blocks} (ALIGN-1)"
                )
            if not c_ids:
                out_p.append([])
                out_c.append([])
                continue
            # SGLang ships every token its lists cover (len(origin_input_ids)); it recomputes none (decision 134 in
            # decisions-engines.md).
            keywords = {"num_tokens": listed, "prefix_tokens": prefix_hit_tokens}
            src = producer_pages(spec, p_ids, first_block=p_first, **keywords)
            dst = consumer_pages(spec, c_ids, first_block=c_first, **keywords)
            paired_p, paired_c = pair_pages(self.backend, src, dst, window=_is_window(spec))
            out_p.append(paired_p)
            out_c.append(paired_c)
        try:
            return BlockPairs(producer_block_ids=BlockIds(out_p), consumer_block_ids=BlockIds(out_c))
        except BlockAlignmentError as exc:
            raise BlockAlignmentError(
                f"SGLang {self.backend} would post these pairs, which kvspec refuses: {exc}"
            ) from exc

    def plan(
        self, *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
    ) -> TransferPlan:
        """kvspec's ``plan_transfer``: SGLang computes byte offsets in its transfer workers (PLAN-1)."""
        return plan_transfer(producer_config=producer_config, consumer_config=consumer_config, pairs=pairs)


class MooncakeConnector(SglangConnector):
    """``sglang:mooncake``: SGLang's index building and Mooncake's pairing (front-truncates a mismatch)."""

    def __init__(self) -> None:
        super().__init__("mooncake")


class NixlConnector(SglangConnector):
    """``sglang:nixl``: SGLang's index building and NIXL's pairing (raises on a mismatch)."""

    def __init__(self) -> None:
        super().__init__("nixl")


class MoriConnector(SglangConnector):
    """``sglang:mori``: SGLang's index building and MORI's pairing (front-truncates a mismatch)."""

    def __init__(self) -> None:
        super().__init__("mori")


_CLASSES: dict[str, Callable[[], SglangConnector]] = {
    "mooncake": MooncakeConnector,
    "nixl": NixlConnector,
    "mori": MoriConnector,
}


def make_connector(name: str) -> SglangConnector:
    """The adapter ``sglang:NAME`` names (``mooncake``, ``nixl``, ``mori``); :class:`ConfigError` otherwise."""
    if name not in _CLASSES:
        raise ConfigError(f"--connector sglang:{name}: expected one of {', '.join('sglang:' + n for n in _CLASSES)}")
    check_sglang_version()
    made = _CLASSES[name]()
    made.warm_up()
    return made
