"""kvspec's guard inside a running vLLM: a KV connector that wraps any vLLM connector and checks every request it moves.

Enabled by configuration alone (docs/how-to/guard-a-deployment.md)::

    --kv-transfer-config '{"kv_connector": "GuardConnector",
                           "kv_connector_module_path": "kvspec.integrations.vllm_guard",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"inner_connector": "NixlConnector",
                                                         "guard_mode": "fail", "guard_sample_rate": 1.0}}'

:class:`GuardConnector` builds the inner connector (a name vLLM registers, or
``inner_module_path`` for a class of your own) with vLLM's own factory, for
the same role, and hands it every call. On top of that it does two things:

- **Rule checks** (consumer scheduler, after the inner connector's
  ``update_state_after_alloc``): on the lists the inner connector recorded and
  the pairs its worker will post, kvspec's definitions of CLIP-1
  (:func:`kvspec.spec.get_exchange_clipped_blocks`), ALIGN-1 and NULL-1
  (:class:`kvspec.spec.BlockPairs`) and WIN-1
  (:func:`kvspec.spec.check_window_coverage`).
- **Page digests**: the producer's workers digest the pages of each sampled
  request after the step that computed them; the digests ride in the
  request's ``kv_transfer_params`` (key ``kvspec_guard``); the consumer's
  workers digest the pages that landed and compare before the request is
  reported finished receiving.

A mismatch is one log line naming the request, the rule and the first
differing page, and a count in ``vllm:kvspec_guard_mismatch_total{rule}``.
Mode ``fail`` then reports the request in ``failed_recving``: vLLM 0.33's
failure path for a receive, per request (``kv_load_failure_policy`` "fail",
vLLM's default, finishes it with ``FINISHED_ERROR``: it never decodes;
"recompute" recomputes it instead). Each tensor-parallel rank checks its own
shard and vLLM's output aggregator fails the request when any rank reports it,
so the ranks agree before the request is dropped. Mode ``raise`` (CI) raises
:class:`kvspec.IntegrityMismatchError`; ``log`` only logs and counts; ``off`` delegates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import os
import re
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvspec.core._errors import ConfigError, IntegrityMismatchError, KVSpecError
from kvspec.core._models import NULL_BLOCK_ID, KVCacheConfig
from kvspec.spec import BlockPairs, GuardMode, check_window_coverage, get_blocks_per_sw, get_exchange_clipped_blocks
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.digest import DigestAlgorithm
from kvspec.spec.integrity import new_block_hash

__all__ = [
    "GUARD_KEYS",
    "PARAMS_KEY",
    "GuardConnector",
    "GuardMetadata",
    "GuardMode",
    "GuardPromMetrics",
    "GuardSettings",
    "GuardStats",
    "GuardWorkerMetadata",
    "Mismatch",
    "check_request_rules",
    "is_sampled",
    "parse_guard_config",
]

if "vllm" not in sys.modules:
    # Imported outside a server (a test, a script): vLLM picks its platform at import, and kvspec runs on the CPU.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1."
_base: Any = importlib.import_module(_V1 + "base")
_metrics: Any = importlib.import_module(_V1 + "metrics")

logger = logging.getLogger("vllm.kvspec_guard")
"""Under vLLM's ``vllm`` logger, so a server prints the guard's lines with its own."""

PARAMS_KEY = "kvspec_guard"
"""The ``kv_transfer_params`` key that carries the producer's page digests to the consumer."""

GUARD_KEYS = ("inner_connector", "inner_module_path", "guard_mode", "guard_sample_rate", "guard_seed", "guard_hooks")
"""Keys of ``kv_connector_extra_config`` the guard reads; every other key goes to the inner connector."""

_BOUND = 4096
"""Requests whose digests or checks the guard keeps at most (oldest dropped first): a peer cannot grow it."""

_RULE = re.compile(r"\(([A-Z]+-\d+)[,)]")


@attrs.frozen(kw_only=True)
class GuardSettings:
    """The guard's part of ``kv_connector_extra_config``; ``inner_extra`` is the rest, for the inner connector."""

    inner_connector: str
    inner_module_path: str | None = None
    mode: GuardMode = GuardMode.FAIL
    sample_rate: float = 1.0
    seed: int = 0
    hooks: str | None = None
    inner_extra: dict[str, Any] = attrs.field(factory=dict)


def parse_guard_config(extra: Mapping[str, Any] | None) -> GuardSettings:
    """The settings in ``kv_connector_extra_config``; :class:`ConfigError` naming the key and what it takes."""
    extra = dict(extra or {})
    inner = extra.get("inner_connector")
    if not isinstance(inner, str) or not inner:
        raise ConfigError(
            "kv_connector_extra_config.inner_connector: expected the name of the vLLM connector to guard "
            f"(e.g. 'NixlConnector'), got {inner!r}"
        )
    if inner == "GuardConnector":
        raise ConfigError("kv_connector_extra_config.inner_connector: a GuardConnector cannot guard itself")
    path = extra.get("inner_module_path")
    if path is not None and (not isinstance(path, str) or not path):
        raise ConfigError(f"kv_connector_extra_config.inner_module_path: expected a module name, got {path!r}")
    raw_mode = extra.get("guard_mode", GuardMode.FAIL.value)
    try:
        mode = GuardMode(raw_mode)
    except ValueError:
        raise ConfigError(
            f"kv_connector_extra_config.guard_mode: expected one of {[m.value for m in GuardMode]}, got {raw_mode!r}"
        ) from None
    rate = extra.get("guard_sample_rate", 1.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"kv_connector_extra_config.guard_sample_rate: expected a number in [0, 1], got {rate!r}")
    seed = extra.get("guard_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"kv_connector_extra_config.guard_seed: expected an integer, got {seed!r}")
    hooks = extra.get("guard_hooks")
    if hooks is not None and (not isinstance(hooks, str) or ":" not in hooks):
        raise ConfigError(f"kv_connector_extra_config.guard_hooks: expected 'MODULE:CLASS', got {hooks!r}")
    return GuardSettings(
        inner_connector=inner,
        inner_module_path=path,
        mode=mode,
        sample_rate=float(rate),
        seed=seed,
        hooks=hooks,
        inner_extra={k: v for k, v in extra.items() if k not in GUARD_KEYS},
    )


def is_sampled(request_id: str, *, rate: float, seed: int) -> bool:
    """Whether the guard checks ``request_id``: a seeded hash of the id below ``rate`` (the same on every rank)."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * (1 << 64)


def _digest_pages(pages: Iterable[bytes | memoryview]) -> str:
    """The digest of one block: its pages in every layer of its group, in the group's layer order (INT-1).

    The one place the algorithm is chosen: today INT-1's BLAKE2b
    (:func:`kvspec.spec.integrity.new_block_hash`), as :class:`kvspec.PageDigester` computes it over a pool.
    """
    h = new_block_hash(DigestAlgorithm.BLAKE2B_128)
    for page in pages:
        h.update(page)
    return h.hexdigest()


@attrs.frozen
class Mismatch:
    """One request that broke a rule: the rule id, the first differing page, and what was found."""

    request_id: str
    rule: str
    page: str
    detail: str

    def line(self) -> str:
        """The log line: request, rule, first differing page, detail."""
        return f"kvspec guard: request {self.request_id} breaks {self.rule} at {self.page}: {self.detail}"


# --------------------------------------------------------------------------- the rule checks


def _rule_of(exc: Exception, default: str) -> str:
    found = _RULE.findall(str(exc))
    return found[-1] if found else default


def _first_missing(expected: Sequence[int], received: Sequence[int]) -> int:
    """Index in ``expected`` of the first id the tail-aligned ``received`` lacks."""
    offset = len(received) - len(expected)
    for i, block in enumerate(expected):
        j = i + offset
        if j < 0 or received[j] != block:
            return i
    return len(expected)


def check_request_rules(
    config: KVCacheConfig,
    request_id: str,
    *,
    num_tokens: int,
    prefix_hit_tokens: int,
    offered: Sequence[Sequence[int]],
    received: Sequence[Sequence[int]],
    pairs: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]],
) -> Mismatch | None:
    """The first rule a consumer-side request breaks, or None (CLIP-1, ALIGN-1, NULL-1, WIN-1).

    ``offered`` is what the engine handed the connector (the consumer's
    uncached blocks), ``received`` the lists the connector recorded,
    ``pairs`` (producer lists, consumer lists) as its worker posts them. The
    consumer loads ``num_tokens - 1`` tokens and recomputes the last, as
    vLLM's P/D connectors do.
    """
    budgets = get_blocks_per_sw(config)
    if len(offered) == len(budgets) and len(received) == len(budgets):
        expected = get_exchange_clipped_blocks(offered, budgets)
        for g, (want, got) in enumerate(zip(expected, received, strict=True)):
            # A connector may receive more (MoRI-IO keeps its whole table) but must end with what CLIP-1 keeps.
            i = _first_missing(want, got)
            if i < len(want):
                return Mismatch(
                    request_id,
                    "CLIP-1",
                    f"group {g} block {want[i]} (position {i} of {len(want)})",
                    f"the connector kept {list(got)}, CLIP-1 keeps {list(want)}",
                )
    producer, consumer = ([list(g) for g in side] for side in pairs)
    if not any(consumer):
        return None
    try:
        BlockPairs(producer_block_ids=producer, consumer_block_ids=consumer)
    except KVSpecError as exc:
        return Mismatch(request_id, _rule_of(exc, "ALIGN-1"), _first_null(producer, consumer), str(exc))
    try:
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=num_tokens - 1,
                recomputed_tokens=1,
                prefix_hit_tokens=prefix_hit_tokens,
                producer_block_ids=producer,
                consumer_block_ids=consumer,
            ),
        )
    except KVSpecError as exc:
        return Mismatch(request_id, _rule_of(exc, "WIN-1"), _named_group(str(exc)), str(exc))
    return None


def _first_null(producer: Sequence[Sequence[int]], consumer: Sequence[Sequence[int]]) -> str:
    for g, (p, c) in enumerate(zip(producer, consumer, strict=False)):
        for i, (a, b) in enumerate(zip(p, c, strict=False)):
            if NULL_BLOCK_ID in (a, b):
                return f"group {g} pair {i} ({a} -> {b})"
        if len(p) != len(c):
            return f"group {g} pair {min(len(p), len(c))}"
    return "the group lists"


def _named_group(text: str) -> str:
    found = re.search(r"group \d+ (?:logical )?blocks? [\d.]+", text)
    return found.group(0) if found else "the needed blocks"


# --------------------------------------------------------------------------- metadata and stats


@dataclasses.dataclass
class _Verify:
    """What one consumer worker checks when the inner connector reports the request received."""

    pairs: list[list[tuple[int, int]]]
    """Per group, (producer id, consumer id) as posted."""
    digests: dict[int, list[dict[int, str]]] | None
    """Per producer TP rank, per group, producer block id -> digest; None when no digest came."""
    failure: Mismatch | None = None
    """A rule the scheduler found broken."""


@dataclasses.dataclass
class GuardMetadata(_base.KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers: the inner connector's metadata, the pages to digest and the requests to verify."""

    inner: Any
    digest: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)
    verify: dict[str, _Verify] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GuardWorkerMetadata(_base.KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler: the inner connector's worker metadata and the producer's page digests per TP rank."""

    inner: Any
    digests: dict[int, dict[str, list[dict[int, str]]]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: GuardWorkerMetadata) -> GuardWorkerMetadata:
        """Merge another rank's: digests by rank, the inner metadata by its own ``aggregate``."""
        inner = self.inner
        if inner is None:
            inner = other.inner
        elif other.inner is not None:
            inner = inner.aggregate(other.inner)
        return GuardWorkerMetadata(inner=inner, digests={**self.digests, **other.digests})


def _empty_counts() -> dict[str, Any]:
    return {"checked": 0, "mismatch": {}, "skipped": {}, "digest_seconds": []}


@dataclasses.dataclass
class GuardStats(_metrics.KVConnectorStats):  # type: ignore[misc]
    """The guard's counters (``data["guard"]``) and the inner connector's stats (``data["inner"]``)."""

    def __post_init__(self) -> None:
        self.data.setdefault("guard", _empty_counts())

    @property
    def counts(self) -> dict[str, Any]:
        """checked, mismatch by rule, skipped by reason, digest latencies in seconds."""
        counts: dict[str, Any] = self.data["guard"]
        return counts

    def _inner(self) -> Any:
        path, data = self.data.get("inner_class"), self.data.get("inner")
        if not path or data is None:
            return None
        module, _, name = str(path).partition(":")
        return getattr(importlib.import_module(module), name).build_kv_connector_stats(data)

    def reset(self) -> None:
        """Clear the counters and the inner stats."""
        self.data = {"guard": _empty_counts()}

    def aggregate(self, other: GuardStats) -> GuardStats:
        """Sum the counters; the inner stats by the inner class's own ``aggregate``."""
        mine, theirs = self.counts, other.counts
        mine["checked"] += theirs["checked"]
        for key in ("mismatch", "skipped"):
            for label, n in theirs[key].items():
                mine[key][label] = mine[key].get(label, 0) + n
        mine["digest_seconds"] = [*mine["digest_seconds"], *theirs["digest_seconds"]]
        a, b = self._inner(), other._inner()
        if b is not None:
            self.data["inner"] = (b if a is None else a.aggregate(b)).data
            self.data["inner_class"] = other.data["inner_class"]
        return self

    def reduce(self) -> dict[str, int | float]:
        """One interval's summary for vLLM's log line, the inner connector's after the guard's."""
        c = self.counts
        out: dict[str, int | float] = {
            "guard_checked": c["checked"],
            "guard_mismatch": sum(c["mismatch"].values()),
            "guard_skipped": sum(c["skipped"].values()),
        }
        inner = self._inner()
        if inner is not None and not inner.is_empty():
            out.update(inner.reduce())
        return out

    def is_empty(self) -> bool:
        """True when nothing was counted and the inner stats are empty."""
        c = self.counts
        inner = self._inner()
        quiet = not (c["checked"] or c["mismatch"] or c["skipped"] or c["digest_seconds"])
        return quiet and (inner is None or inner.is_empty())


class GuardPromMetrics(_metrics.KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:kvspec_guard_*`` per engine, and the inner connector's own Prometheus metrics."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        inner: Any,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = inner
        self._checked = self._counter_cls(
            name="vllm:kvspec_guard_requests_checked",
            documentation="Requests the kvspec guard checked (rules, digests, or both).",
            labelnames=labelnames,
        )
        self._mismatch = self._counter_cls(
            name="vllm:kvspec_guard_mismatch",
            documentation="Requests whose KV broke a kvspec rule (CLIP-1, ALIGN-1, NULL-1, WIN-1, INT-1), by rule.",
            labelnames=[*labelnames, "rule"],
        )
        self._skipped = self._counter_cls(
            name="vllm:kvspec_guard_skipped",
            documentation="Requests the kvspec guard did not verify, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self._latency = self._histogram_cls(
            name="vllm:kvspec_guard_digest_seconds",
            documentation="Time one worker spent digesting one request's pages.",
            buckets=[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0],
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's guard counters, then hand the inner connector its part."""
        values = self.per_engine_labelvalues[engine_idx]
        counts = transfer_stats_data.get("guard") or _empty_counts()
        if counts["checked"]:
            self._checked.labels(*values).inc(counts["checked"])
        for rule, n in counts["mismatch"].items():
            self._mismatch.labels(*values, rule).inc(n)
        for reason, n in counts["skipped"].items():
            self._skipped.labels(*values, reason).inc(n)
        for seconds in counts["digest_seconds"]:
            self._latency.labels(*values).observe(seconds)
        if self._inner is not None and transfer_stats_data.get("inner") is not None:
            self._inner.observe(transfer_stats_data["inner"], engine_idx)


# --------------------------------------------------------------------------- the connector


def _lookup_config(settings: GuardSettings) -> Any:
    """What vLLM's ``KVConnectorFactory.get_connector_class`` reads of a transfer config, for the inner connector.

    vLLM 0.34's factory also asks ``get_from_extra_config("transfer_mode", ...)`` to pick NIXL pull or push.
    """
    extra = dict(settings.inner_extra)
    return types.SimpleNamespace(
        kv_connector=settings.inner_connector,
        kv_connector_module_path=settings.inner_module_path,
        kv_connector_extra_config=extra,
        get_from_extra_config=lambda key, default: extra.get(key, default),
    )


def _inner_config(vllm_config: Any, settings: GuardSettings) -> Any:
    """A shallow copy of ``vllm_config`` whose transfer config names the inner connector and its extra config."""
    outer = vllm_config.kv_transfer_config
    inner = dataclasses.replace(
        outer,
        kv_connector=settings.inner_connector,
        kv_connector_module_path=settings.inner_module_path,
        kv_connector_extra_config=dict(settings.inner_extra),
    )
    config = vllm_config.__class__.__new__(vllm_config.__class__)
    config.__dict__.update(vllm_config.__dict__)
    config.__dict__["kv_transfer_config"] = inner
    return config


def _settings_of(vllm_config: Any) -> GuardSettings:
    return parse_guard_config(vllm_config.kv_transfer_config.kv_connector_extra_config)


def _factory() -> Any:
    return importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory


def _inner_class(vllm_config: Any) -> Any:
    return _factory().get_connector_class(_inner_config(vllm_config, _settings_of(vllm_config)).kv_transfer_config)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _adapters() -> types.ModuleType:
    """kvspec's vLLM adapters (hooks, config translation), imported so that a running server is left as it was.

    They set ``VLLM_TARGET_DEVICE=cpu`` and quiet vLLM's logger for kvspec's
    own CLI; inside a server neither may happen.
    """
    serving = "kvspec.integrations.vllm" not in sys.modules
    had_device = "VLLM_TARGET_DEVICE" in os.environ
    module = importlib.import_module("kvspec.integrations.vllm")
    if serving:
        module._QUIETED.append(True)
        if not had_device:
            os.environ.pop("VLLM_TARGET_DEVICE", None)
    return module


def _tp_rank() -> int:
    try:
        parallel = importlib.import_module("vllm.distributed.parallel_state")
        return int(parallel.get_tensor_model_parallel_rank())
    except Exception:  # no distributed group (a test, a single process): rank 0
        return 0


class GuardConnector(_base.KVConnectorBase_V1, _base.SupportsHMA):  # type: ignore[misc]
    """A vLLM KV connector that runs kvspec's rule checks and page digests around any other vLLM connector.

    Built by vLLM's factory from ``--kv-transfer-config`` (module docstring);
    ``kv_connector_extra_config`` holds the guard's keys (:data:`GUARD_KEYS`)
    and the inner connector's own.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = _settings_of(vllm_config)
        inner_config = _inner_config(vllm_config, self.settings)
        factory = _factory()
        inner_cls = factory.get_connector_class(inner_config.kv_transfer_config)
        hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma and not factory.supports_hma_config(inner_config.kv_transfer_config):
            raise ValueError(
                f"Connector {inner_cls.__name__} (guarded) does not support HMA but HMA is enabled. "
                "Please set `--disable-hybrid-kv-cache-manager`."
            )
        self.inner = inner_cls(inner_config, role, kv_cache_config)
        self._inner_cls = inner_cls
        self._mode = self.settings.mode
        self._counts = _empty_counts()
        self._tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))
        # scheduler side
        self._kvspec_config: KVCacheConfig | None = None
        self._hooks: Any = None
        self._hit: OrderedDict[str, int] = OrderedDict()
        self._producing: OrderedDict[str, Any] = OrderedDict()
        self._awaiting: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._digested: OrderedDict[str, dict[int, list[dict[int, str]]]] = OrderedDict()
        self._to_verify: dict[str, _Verify] = {}
        self._sync: OrderedDict[str, bool] = OrderedDict()
        # worker side
        self._caches: dict[str, Any] = {}
        self._verify: OrderedDict[str, _Verify] = OrderedDict()
        self._made: dict[str, list[dict[int, str]]] = {}
        self._digest_jobs: dict[str, list[list[int]]] = {}
        if role == _base.KVConnectorRole.SCHEDULER and self._mode is not GuardMode.OFF:
            self._prepare_checks(kv_cache_config)

    # -- what vLLM and kvspec's adapters read

    @property
    def connector_scheduler(self) -> Any:
        """The inner connector's scheduler-side object (kvspec's adapters build a guarded connector through it)."""
        return getattr(self.inner, "connector_scheduler", self.inner)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self.inner.supports_divergent_local_hybrid_hits)

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self.inner.requires_kv_delivery)

    def __getattr__(self, name: str) -> Any:
        # A method of the inner class the base class does not declare (e.g. a connector's own hooks).
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        layout: str | None = _inner_class(vllm_config).get_required_kvcache_layout(
            _inner_config(vllm_config, _settings_of(vllm_config))
        )
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        settings = parse_guard_config(extra_config)
        config = _lookup_config(settings)
        return bool(_factory().get_connector_class(config).requires_piecewise_for_cudagraph(settings.inner_extra))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        settings = parse_guard_config(kv_transfer_config.kv_connector_extra_config)
        config = _lookup_config(settings)
        return bool(_factory().get_connector_class(config).supports_sleep_mode(kv_transfer_config))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GuardStats:
        return GuardStats(data=dict(data)) if data is not None else GuardStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> GuardPromMetrics:
        inner_config = _inner_config(vllm_config, _settings_of(vllm_config))
        inner = _inner_class(vllm_config).build_prom_metrics(
            inner_config, metric_types, labelnames, per_engine_labelvalues
        )
        return GuardPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, inner)

    # -- counting and reporting

    def _count(self, key: str, label: str) -> None:
        self._counts[key][label] = self._counts[key].get(label, 0) + 1

    def _found(self, mismatch: Mismatch) -> None:
        """Log and count one mismatch; raise in mode ``raise``."""
        self._count("mismatch", mismatch.rule)
        logger.error("%s (mode %s)", mismatch.line(), self._mode.value)
        if self._mode is GuardMode.RAISE:
            raise IntegrityMismatchError(
                mismatch.line(), rule=mismatch.rule, request_id=mismatch.request_id, page=mismatch.page
            )

    def get_kv_connector_stats(self) -> GuardStats | None:
        inner = self.inner.get_kv_connector_stats()
        data: dict[str, Any] = {"guard": self._counts}
        if inner is not None:
            data["inner"] = inner.data
            data["inner_class"] = _class_path(self._inner_cls)
        self._counts = _empty_counts()
        stats = GuardStats(data=data)
        return None if stats.is_empty() else stats

    # -- scheduler side: the rule checks, and the digests in and out of kv_transfer_params

    def _prepare_checks(self, kv_cache_config: Any) -> None:
        adapters = _adapters()
        try:
            self._kvspec_config = adapters.from_vllm_kv_cache_config(kv_cache_config)
        except KVSpecError as exc:
            logger.warning("kvspec guard: no rule checks for this model (%s); page digests still run", exc)
        scheduler = self.connector_scheduler
        if self.settings.hooks:
            self._hooks = adapters.import_path(self.settings.hooks, "guard_hooks")()
        else:
            self._hooks = adapters.shape_of(self._inner_cls, scheduler)
        if self._hooks is None:
            logger.warning(
                "kvspec guard: %s derives from no connector kvspec knows; set guard_hooks to a "
                "kvspec.integrations.vllm.VllmHooks subclass for the rule checks",
                _class_path(self._inner_cls),
            )

    def _sampled(self, request_id: str) -> bool:
        return is_sampled(request_id, rate=self.settings.sample_rate, seed=self.settings.seed)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._hit.pop(request.request_id, None)
        _remember(self._hit, request.request_id, num_computed_tokens)
        result: tuple[int | None, bool] = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._sync.pop(request.request_id, None)
        if result[0] and not result[1]:
            _remember(self._sync, request.request_id, True)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        # Read before the inner connector runs: NIXL turns do_remote_prefill off once it has recorded the load.
        decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if self._mode is GuardMode.OFF:
            return
        rid = request.request_id
        if decode and self._sampled(rid):
            _remember(self._producing, rid, request)
            return
        if not prefill or num_external_tokens <= 0:
            return
        # The producer's choice wins: a request it digested is verified whatever this side's sample says.
        if PARAMS_KEY not in params and not self._sampled(rid):
            self._count("skipped", "not-sampled")
            return
        self._counts["checked"] += 1
        verify = _Verify(pairs=[], digests=None)
        if self._kvspec_config is None or self._hooks is None:
            self._count("skipped", "rules-unavailable")
        else:
            verify = self._check_rules(request, blocks, params)
            if verify.failure is not None:
                self._found(verify.failure)
        if rid in self._sync:
            # A synchronous load is never reported received: its bytes cannot be held back (its lists were checked).
            del self._sync[rid]
            self._count("skipped", "sync-load")
            return
        verify.digests = self._expected_digests(rid, params)
        self._to_verify[rid] = verify

    def _check_rules(self, request: Any, blocks: Any, params: Mapping[str, Any]) -> _Verify:
        config = self._kvspec_config
        assert config is not None
        rid = request.request_id
        scheduler = self.connector_scheduler
        remote = [list(g) for g in params.get("remote_block_ids") or ()]
        try:
            received = [list(g) for g in self._hooks.received_block_ids(scheduler, rid)]
            paired = self._hooks.pair(scheduler, config, remote, received) if any(received) else ([], [])
        except KVSpecError as exc:
            refused = Mismatch(rid, _rule_of(exc, "ALIGN-1"), "the pairing", str(exc))
            return _Verify(pairs=[], digests=None, failure=refused)
        offered = [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
        failure = check_request_rules(
            config,
            rid,
            num_tokens=request.num_prompt_tokens,
            prefix_hit_tokens=self._hit.get(rid, 0),
            offered=offered,
            received=received,
            pairs=paired,
        )
        pairs = [list(zip(p, c, strict=False)) for p, c in zip(*paired, strict=False)]
        return _Verify(pairs=pairs, digests=None, failure=failure)

    def _expected_digests(self, rid: str, params: Mapping[str, Any]) -> dict[int, list[dict[int, str]]] | None:
        sent = params.get(PARAMS_KEY)
        if not isinstance(sent, Mapping) or not sent.get("ranks"):
            self._count("skipped", "no-producer-digest")
            return None
        if sent.get("tp_size") != self._tp_size:
            # Digests of a producer rank's shard match only the same shard: until the canonical page.
            self._count("skipped", "tp")
            return None
        blocks = sent.get("blocks") or []
        out: dict[int, list[dict[int, str]]] = {}
        try:
            for rank, groups in dict(sent["ranks"]).items():
                out[int(rank)] = [
                    {int(b): str(d) for b, d in zip(ids, digests, strict=True) if b != NULL_BLOCK_ID}
                    for ids, digests in zip(blocks, groups, strict=True)
                ]
        except (TypeError, ValueError):
            self._count("skipped", "bad-producer-digest")
            return None
        return out

    def build_connector_meta(self, scheduler_output: Any) -> GuardMetadata:
        inner = self.inner.build_connector_meta(scheduler_output)
        meta = GuardMetadata(inner=inner, verify=self._to_verify)
        self._to_verify = {}
        manager = self._kv_cache_manager
        if self._producing and manager is not None:
            for rid in scheduler_output.num_scheduled_tokens:
                if rid in self._producing:
                    meta.digest[rid] = [list(g) for g in manager.get_block_ids(rid)]
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = self.inner.request_finished(request, block_ids)
        return delay, self._offer_digests(request, params, [block_ids])

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if _base.supports_hma(self.inner):
            delay, params = self.inner.request_finished_all_groups(request, block_ids)
        else:
            delay, params = self.inner.request_finished(request, block_ids[0])
        return delay, self._offer_digests(request, params, list(block_ids))

    def _offer_digests(
        self, request: Any, params: dict[str, Any] | None, block_ids: Sequence[Sequence[int]]
    ) -> dict[str, Any] | None:
        """Put the digests slot into ``params``; the workers' digests of the last step fill it in place.

        vLLM 0.33 calls ``request_finished`` and then, in the same
        ``update_from_output``, ``update_connector_output`` with the worker
        metadata of the step that computed the last token; the outputs are
        serialized after both, so the filled slot reaches the consumer.
        """
        rid = request.request_id
        if self._producing.pop(rid, None) is None or not params:
            return params
        sent = params.get("remote_block_ids") or block_ids
        slot: dict[str, Any] = {"tp_size": self._tp_size, "blocks": [list(g) for g in sent], "ranks": {}}
        params[PARAMS_KEY] = slot
        # Not filled from digests already here: they are an earlier chunk's; the last step's come next.
        self._digested.pop(rid, None)
        _remember(self._awaiting, rid, slot)
        return params

    def _fill(self, rid: str) -> None:
        slot, made = self._awaiting.get(rid), self._digested.get(rid)
        if slot is None or made is None:
            return
        for rank, groups in made.items():
            slot["ranks"][str(rank)] = [
                [groups[g].get(b, "") if g < len(groups) else "" for b in ids] for g, ids in enumerate(slot["blocks"])
            ]
        del self._awaiting[rid]
        del self._digested[rid]

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, GuardWorkerMetadata):
            for rank, by_request in meta.digests.items():
                for rid, groups in by_request.items():
                    _remember(self._digested, rid, {})[rank] = groups
            for rid in list(self._awaiting):
                self._fill(rid)
            connector_output = dataclasses.replace(connector_output, kv_connector_worker_meta=meta.inner)
        stats = connector_output.kv_connector_stats
        if isinstance(stats, GuardStats):
            connector_output = dataclasses.replace(connector_output, kv_connector_stats=stats._inner())
        self.inner.update_connector_output(connector_output)

    # -- worker side: digest what the producer computed, verify what the consumer received

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._caches = dict(kv_caches)
        self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        if isinstance(connector_metadata, GuardMetadata):
            for rid, verify in connector_metadata.verify.items():
                _remember(self._verify, rid, verify)
            self._digest_jobs = connector_metadata.digest
            connector_metadata = connector_metadata.inner
        super().bind_connector_metadata(connector_metadata)
        self.inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, GuardMetadata):
            kv_connector_metadata = kv_connector_metadata.inner
        self.inner.handle_preemptions(kv_connector_metadata)

    def _page_digests(self, group: int, block_ids: Iterable[int]) -> dict[int, str]:
        layers = [n for n in self._kv_cache_config.kv_cache_groups[group].layer_names if n in self._caches]
        num_blocks = self._kv_cache_config.num_blocks
        out: dict[int, str] = {}
        for block in block_ids:
            if block == NULL_BLOCK_ID or block in out:
                continue
            out[block] = _digest_pages(_page_bytes(self._caches[n], block, num_blocks) for n in layers)
        return out

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()
        if not self._digest_jobs or not self._caches or self._mode is GuardMode.OFF:
            self._digest_jobs = {}
            return
        for rid, groups in self._digest_jobs.items():
            started = time.perf_counter()
            self._made[rid] = [self._page_digests(g, ids) for g, ids in enumerate(groups)]
            self._counts["digest_seconds"].append(time.perf_counter() - started)
        self._digest_jobs = {}

    def build_connector_worker_meta(self) -> Any:
        inner = self.inner.build_connector_worker_meta()
        if not self._made:
            return inner
        meta = GuardWorkerMetadata(inner=inner, digests={_tp_rank(): self._made})
        self._made = {}
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = self.inner.get_transfer_results(finished_req_ids)
        for rid in sorted(results.finished_recving):
            verify = self._verify.pop(rid, None)
            if verify is None or self._mode is GuardMode.OFF or rid in results.failed_recving:
                continue
            mismatch = verify.failure or self._verify_pages(rid, verify)
            if mismatch is None:
                continue
            if verify.failure is None:
                self._found(mismatch)  # a rule failure was logged and counted by the scheduler
            if self._mode is GuardMode.FAIL:
                results.failed_recving.add(rid)
        return results

    def _verify_pages(self, rid: str, verify: _Verify) -> Mismatch | None:
        if verify.digests is None:
            return None
        if not self._caches:
            # The inner connector's worker was handed no cache tensors to read: nothing can be compared.
            self._count("skipped", "no-kv-caches")
            return None
        rank = _tp_rank()
        expected = verify.digests.get(rank)
        if expected is None:
            self._count("skipped", "no-producer-digest")
            return None
        started = time.perf_counter()
        try:
            for g, pairs in enumerate(verify.pairs):
                got = self._page_digests(g, (c for _, c in pairs))
                for i, (p, c) in enumerate(pairs):
                    want = expected[g].get(p) if g < len(expected) else None
                    if not want:
                        continue  # the producer did not digest this block (not in its sent list)
                    if got.get(c) != want:
                        page = f"group {g} pair {i} (producer block {p} -> consumer block {c}, TP rank {rank})"
                        return Mismatch(rid, "INT-1", page, "the received page's digest differs from the producer's")
        finally:
            self._counts["digest_seconds"].append(time.perf_counter() - started)
        return None

    # -- plain delegation

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        found: set[int] = self.inner.get_block_ids_with_load_errors()
        return found

    def get_mem_pool_context(self) -> Any:
        return self.inner.get_mem_pool_context()

    def unregister_kv_caches(self) -> None:
        self._caches = {}
        self.inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.inner.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        self.inner.reset_capture_state()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> Any:
        return self.inner.get_handshake_metadata()

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def get_finished_count(self) -> int | None:
        count: int | None = self.inner.get_finished_count()
        return count

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        groups: tuple[int, ...] = self.inner.get_loaded_kv_cache_group_ids(request)
        return groups

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def on_new_request(self, request: Any) -> None:
        self.inner.on_new_request(request)

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        return bool(self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads))

    def take_events(self) -> Any:
        return self.inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return bool(self.inner.has_pending_block_frees())

    def has_pending_push_work(self) -> bool:
        return bool(self.inner.has_pending_push_work())

    def reset_cache(self) -> bool | None:
        result: bool | None = self.inner.reset_cache()
        return result


def _remember(table: OrderedDict[str, Any], key: str, value: Any) -> Any:
    """Keep ``value`` under ``key`` (an existing entry wins), dropping the oldest entry past :data:`_BOUND`."""
    if key not in table:
        table[key] = value
        while len(table) > _BOUND:
            table.popitem(last=False)
    return table[key]


def _page_bytes(tensor: Any, block: int, num_blocks: int) -> memoryview:
    """Block ``block``'s page of one layer's cache tensor, as bytes (host copy of a device tensor).

    vLLM's attention backends put the block axis first, or second after a
    K/V axis of 2; the axis whose size is the pool's block count is taken.
    """
    axis = 0 if tensor.shape[0] == num_blocks else 1
    page = tensor.select(axis, block).contiguous()
    flat = page.reshape(-1).view(dtype=_uint8()).cpu()
    return memoryview(flat.numpy())


def _uint8() -> Any:
    return importlib.import_module("torch").uint8
