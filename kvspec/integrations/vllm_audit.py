"""Whole P/D requests through vLLM's own KVCacheManagers and connector hooks, checked by kvspec's oracle.

The Connector seam sees the lists a scenario hands it. Real lists come from
vLLM's managers: the producer's table after its sliding-window pruning, the
consumer's table after prefix hits and lookahead slots. This driver builds
both engines' ``KVCacheManager`` (vLLM's, with its pruning) and each
connector's scheduler, and calls them in the order vLLM's scheduler does:

- producer: ``on_new_request``, ``get_computed_blocks``,
  ``get_num_new_matched_tokens``, ``allocate_slots`` in chunks, then
  ``remove_skipped_blocks`` and ``get_block_ids_for_computed_tokens`` as
  ``_connector_finished`` does, and the connector's ``request_finished``;
- consumer: ``on_new_request``, ``get_computed_blocks``, the connector's
  ``get_num_new_matched_tokens``, ``allocate_slots`` (lookahead slots only
  for a synchronous load, as vLLM's scheduler does), the connector's
  ``update_state_after_alloc``, and the connector's pairing.

Both full block tables map every logical block to an id, so each pair the
connector would post is checked by position: a pair must join the same
logical block on both sides (ALIGN-1), never the null block (NULL-1), and
every block the consumer's first computed token attends must arrive or be
held (WIN-1): each one is read, whatever its source (the transfer, the
consumer's prefix hit, or a block the consumer nulled itself), and a null
page into a cached block is ``null-into-cached-block``. With
``connector="reference"`` kvspec's own functions replace NIXL's clipping and
pairing on NIXL's tables: the oracle must then find nothing.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec.core._errors import BlockAlignmentError, KVSpecError, WindowCoverageError
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    TransferMode,
)
from kvspec.integrations.vllm import (
    VllmConnector,
    VllmHooks,
    import_vllm,
    installed_vllm_version,
    to_vllm_kv_cache_config,
)
from kvspec.reference._reference import (
    check_window_coverage,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
    get_needed_block_range,
)
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.state import check_state_position, get_state_clipped_blocks, is_state_spec

__all__ = [
    "AUDIT_CONNECTORS",
    "DEVIATIONS",
    "AuditCase",
    "AuditReport",
    "ClassResult",
    "Deviation",
    "Finding",
    "GroupShape",
    "Speculation",
    "audit_case",
    "check_drive",
    "check_expected",
    "check_kvspec",
    "generate_cases",
    "generate_speculation_cases",
    "generate_state_cases",
    "run_audit",
]

AUDIT_CONNECTORS = ("moriio", "nixl", "mooncake", "reference")
"""Connectors the audit drives; ``reference`` is kvspec's own functions on the same vLLM tables."""


@attrs.frozen(kw_only=True)
class Deviation:
    """A class of deviation: its id, the rule it breaks, and what it does to the request."""

    id: str
    rule: str
    title: str
    consequence: str


DEVIATIONS: dict[str, Deviation] = {
    d.id: d
    for d in (
        Deviation(
            id="reads-null-block",
            rule="NULL-1",
            title="a pair reads the producer's null block into a block the consumer attends",
            consequence="wrong KV read: the consumer attends the null block's bytes",
        ),
        Deviation(
            id="writes-null-block",
            rule="NULL-1",
            title="a pair writes into the consumer's null block",
            consequence="the shared null block is overwritten",
        ),
        Deviation(
            id="shifted-pair",
            rule="ALIGN-1",
            title="a pair joins different logical blocks on the two sides",
            consequence="wrong KV read: a block holds its neighbour's tokens",
        ),
        Deviation(
            id="writes-cached-prefix",
            rule="WIN-1",
            title="a pair writes into a block the consumer already holds from its prefix cache",
            consequence="prefix cache rewritten in place: blocks other requests share receive the producer's bytes",
        ),
        Deviation(
            id="null-into-cached-block",
            rule="NULL-1",
            title="a pair writes the producer's null block into a block the consumer holds from its prefix cache",
            consequence="prefix cache poisoned: the cached block now holds the null block's bytes, for this request "
            "and every later one that hits it",
        ),
        Deviation(
            id="needed-block-null-on-consumer",
            rule="WIN-1",
            title="a block the recomputed token attends is the null block on the consumer",
            consequence="wrong KV read: the attended block was never allocated",
        ),
        Deviation(
            id="needed-block-not-transferred",
            rule="WIN-1",
            title="a block the recomputed token attends is neither held nor transferred",
            consequence="wrong KV read: the block keeps whatever it held before",
        ),
        Deviation(
            id="state-position",
            rule="STATE-1",
            title="the producer's state has absorbed a different number of tokens than the consumer resumes at",
            consequence="wrong recurrent state: tokens skipped, or the recomputed ones applied twice",
        ),
        Deviation(
            id="state-wrong-slot",
            rule="STATE-3",
            title="a state group's pair reads a slot other than the one holding the producer's state, or writes one "
            "the consumer does not resume from",
            consequence="wrong recurrent state: a scratch or stale slot travels, or the state lands where no kernel "
            "reads it",
        ),
        Deviation(
            id="state-scratch-travels",
            rule="STATE-2",
            title="a speculative scratch slot travels, besides the state",
            consequence="extra bytes moved into the consumer's scratch slot; the state itself is right",
        ),
        Deviation(
            id="state-not-transferred",
            rule="STATE-3",
            title="the consumer loads tokens but no pair fills the slot it resumes from",
            consequence="wrong recurrent state: decode starts from whatever the slot held (a zeroed or stale state)",
        ),
        Deviation(
            id="refused",
            rule="FAIL-1",
            title="the connector raises while handling a request the engines admitted",
            consequence="request refused",
        ),
        Deviation(
            id="kvspec-refuses-correct-lists",
            rule="WIN-1",
            title="kvspec's check_window_coverage refuses lists the oracle finds correct",
            consequence="kvspec strictness: a correct connector would fail the suite",
        ),
        Deviation(
            id="kvspec-accepts-wrong-lists",
            rule="ALIGN-1",
            title="kvspec's compute_transfer_pairs accepts lists whose pairs the oracle finds wrong",
            consequence="kvspec blind spot: a wrong connector would pass the suite",
        ),
    )
}


# --------------------------------------------------------------------------- random cases


@attrs.frozen(kw_only=True)
class GroupShape:
    """One group of an audit config: full attention, a sliding window of ``window`` tokens, or a state group.

    A state group (``state`` names its kind, e.g. ``gdn_attn``) has vLLM's
    ``cache_mode`` (``align``: prefix caching, one slot per ``block_size``
    tokens; ``none``: one slot) and ``num_speculative_blocks`` scratch slots
    (STATE-2, STATE-4).
    """

    block_size: int
    window: int = 0
    state: str = ""
    cache_mode: str = "none"
    num_speculative_blocks: int = 0

    def describe(self) -> str:
        """``full/B16``, ``sw128/B16``, or ``gdn_attn/align/B16`` (``+spec2`` with scratch slots)."""
        if self.state:
            spec = f"+spec{self.num_speculative_blocks}" if self.num_speculative_blocks else ""
            return f"{self.state}/{self.cache_mode}/B{self.block_size}{spec}"
        return f"sw{self.window}/B{self.block_size}" if self.window else f"full/B{self.block_size}"


@attrs.frozen(kw_only=True)
class Speculation:
    """One engine's speculative decoding, as vLLM's block logic reads it (STATE-1, STATE-2).

    ``tokens`` draft tokens a step (``num_speculative_tokens``) give as many
    lookahead slots (EAGLE and MTP) and, unless ``scratch`` says otherwise,
    as many scratch slots per state group (``num_speculative_blocks``; 0
    under ReplaySSM). ``multi_module``: MTP with several modules
    (``use_multi_module_mtp``), whose drafter reads ``tokens`` prompt tokens
    ahead (``num_prefill_lookahead_tokens``); one module or EAGLE reads one.
    """

    tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    multi_module: bool = False
    scratch: int = attrs.field(
        default=attrs.Factory(lambda self: self.tokens, takes_self=True), validator=attrs.validators.ge(0)
    )

    @property
    def prefill_lookahead(self) -> int:
        """vLLM's ``num_prefill_lookahead_tokens`` for this speculation."""
        if not self.tokens:
            return 0
        return self.tokens if self.multi_module else 1

    def describe(self) -> str:
        """``none``, ``mtp2``, ``mtp3x3`` (multi-module), with ``/scratch0`` when the scratch count differs."""
        if not self.tokens and not self.scratch:
            return "none"
        text = f"mtp{self.tokens}x{self.tokens}" if self.multi_module else f"mtp{self.tokens}"
        return text + (f"/scratch{self.scratch}" if self.scratch != self.tokens else "")


@attrs.frozen(kw_only=True)
class AuditCase:
    """One request: the config's groups, N prompt tokens, a cached prefix offered to C, lookahead slots.

    Both engines run ``lookahead`` speculative tokens and the groups' scratch
    slots, unless ``producer`` and ``consumer`` give each engine its own
    :class:`Speculation` (deployments run different ones on the two sides).
    """

    index: int
    groups: tuple[GroupShape, ...]
    num_tokens: int
    cached_prefix_tokens: int
    lookahead: int
    producer: Speculation | None = None
    consumer: Speculation | None = None

    def speculation(self, side: str) -> Speculation:
        """The ``producer`` or ``consumer`` engine's speculation."""
        own = self.producer if side == "producer" else self.consumer
        if own is not None:
            return own
        scratch = max((g.num_speculative_blocks for g in self.groups if g.state), default=self.lookahead)
        return Speculation(tokens=self.lookahead, scratch=scratch)

    def side_groups(self, side: str) -> tuple[GroupShape, ...]:
        """The groups as that engine builds them: its own scratch count in each state group."""
        if (self.producer if side == "producer" else self.consumer) is None:
            return self.groups
        scratch = self.speculation(side).scratch
        return tuple(attrs.evolve(g, num_speculative_blocks=scratch) if g.state else g for g in self.groups)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready."""
        out: dict[str, object] = {
            "groups": [g.describe() for g in self.groups],
            "num_tokens": self.num_tokens,
            "cached_prefix_tokens": self.cached_prefix_tokens,
            "lookahead": self.lookahead,
        }
        if self.producer is not None or self.consumer is not None:
            sides = (self.speculation("producer").describe(), self.speculation("consumer").describe())
            out["speculation"] = f"P {sides[0]}, D {sides[1]}"
        return out


_BLOCK_SIZES = (16, 32, 64)
_MAX_TOKENS = 200_000


def _window(rng: random.Random, block_size: int) -> int:
    base = rng.choice((32, 64, 128, 256, 512, 1024, 2048, 4096, rng.randint(32, 4096)))
    return max(32, min(4096, base + rng.choice((0, 0, 1, -1, block_size, -block_size))))


def _num_tokens(rng: random.Random, block_size: int, windows: Sequence[int]) -> int:
    roll = rng.random()
    if roll < 0.15:
        n = rng.randint(1, 4 * block_size)
    elif roll < 0.5 and windows:
        # Land on a WIN-1 boundary: (N - W + 1) % B == 0 or its neighbours.
        w = rng.choice(windows)
        k = rng.randint(1, 64 if rng.random() < 0.7 else max(1, (_MAX_TOKENS - w) // block_size))
        n = k * block_size + w - 1 + rng.choice((0, 0, 1, -1, 2))
    elif roll < 0.7:
        # (N - 1) % B == 0: the consumer's recomputed token starts a block.
        n = rng.randint(1, 400) * block_size + 1
    else:
        n = int(2 ** rng.uniform(4, 17.6))
    return max(1, min(_MAX_TOKENS, n))


def _cached_prefix(rng: random.Random, n: int, block_size: int, windows: Sequence[int]) -> int:
    """A prefix hit for about half the requests; in most of them it holds a block token N - 1's window attends."""
    if n <= block_size or rng.random() >= 0.5:
        return 0
    top = (n - 1) // block_size
    if windows and rng.random() < 0.7:
        # The window of token N - 1 opens at N - W: a hit past that block leaves an attended block cached.
        low = (max(0, n - rng.choice(windows)) // block_size) + 1
        if low <= top:
            return rng.randint(low, top) * block_size
    return rng.randint(1, top) * block_size


def generate_cases(count: int, seed: int) -> list[AuditCase]:
    """``count`` random requests on random hybrid configs, reproducible from ``seed`` (WIN-1)."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        block_size = rng.choice(_BLOCK_SIZES)
        windows = sorted({_window(rng, block_size) for _ in range(rng.choice((1, 1, 2)))})
        groups = (GroupShape(block_size=block_size), *(GroupShape(block_size=block_size, window=w) for w in windows))
        n = _num_tokens(rng, block_size, windows)
        cached = _cached_prefix(rng, n, block_size, windows)
        lookahead = rng.choice((0, 0, 0, 1, 2, 3, 4, 7))
        cases.append(
            AuditCase(index=index, groups=groups, num_tokens=n, cached_prefix_tokens=cached, lookahead=lookahead)
        )
    return cases


_STATE_KINDS = ("mamba1", "mamba2", "gdn_attn")
"""The state kinds the audit draws: those vLLM's NIXL path transfers (Mamba-1, Mamba-2, GDN)."""


def generate_state_cases(count: int, seed: int, first_index: int = 0) -> list[AuditCase]:
    """``count`` random requests on FA + state-group configs, reproducible from ``seed`` (STATE-1 .. STATE-4).

    Each config is one full-attention group and one or two state groups of
    one kind, cache mode and scratch count (MoRI-IO requires identical state
    specs). ``align`` mode is vLLM's prefix caching: about half its requests
    get a consumer prefix hit on a state boundary. Speculative decoding draws
    ``lookahead`` tokens and as many scratch slots per state group.
    """
    rng = random.Random(f"state-{seed}")
    cases = []
    for index in range(first_index, first_index + count):
        block_size = rng.choice(_BLOCK_SIZES)
        kind = rng.choice(_STATE_KINDS)
        mode = rng.choice(("none", "align"))
        lookahead = rng.choice((0, 0, 0, 1, 2, 3))
        state = GroupShape(block_size=block_size, state=kind, cache_mode=mode, num_speculative_blocks=lookahead)
        groups = (GroupShape(block_size=block_size), *([state] * rng.choice((1, 1, 2))))
        roll = rng.random()
        if roll < 0.15:
            n = rng.randint(1, 4 * block_size)
        elif roll < 0.55:
            # (N - 1) % B == 0: the token the consumer recomputes starts a new state slot in align mode.
            n = rng.randint(1, 300) * block_size + 1
        elif roll < 0.7:
            n = rng.randint(1, 300) * block_size + rng.choice((0, 2, -1))
        else:
            n = int(2 ** rng.uniform(4, 16))
        n = max(1, min(_MAX_TOKENS, n))
        cached = 0
        if mode == "align" and n > block_size + 1 and rng.random() < 0.5:
            cached = rng.randint(1, (n - 2) // block_size) * block_size
        cases.append(
            AuditCase(index=index, groups=groups, num_tokens=n, cached_prefix_tokens=cached, lookahead=lookahead)
        )
    return cases


_SPECULATIONS = (
    Speculation(),
    Speculation(tokens=1),
    Speculation(tokens=2),
    Speculation(tokens=3),
    Speculation(tokens=2, multi_module=True),
    Speculation(tokens=3, multi_module=True),
    Speculation(tokens=2, scratch=0),
)
"""What one engine may run: none, MTP (one module) of depth 1 to 3, multi-module MTP, ReplaySSM (no scratch)."""


def generate_speculation_cases(count: int, seed: int, first_index: int = 0) -> list[AuditCase]:
    """``count`` random requests whose two engines run different speculation, reproducible from ``seed``.

    Deployments pick the decoder's speculation (MTP depth, multi-module MTP,
    scratch slots) apart from the prefiller's; each request draws two
    different :class:`Speculation` from the same menu on an FA + state-group
    config (STATE-1: token counts; STATE-2, STATE-3: which slot travels).
    """
    rng = random.Random(f"speculation-{seed}")
    cases = []
    for index in range(first_index, first_index + count):
        block_size = rng.choice(_BLOCK_SIZES)
        producer, consumer = rng.sample(_SPECULATIONS, 2)
        state = GroupShape(
            block_size=block_size,
            state=rng.choice(_STATE_KINDS),
            cache_mode=rng.choice(("none", "align")),
            num_speculative_blocks=producer.scratch,
        )
        roll = rng.random()
        if roll < 0.2:
            n = rng.randint(2, 4 * block_size)
        elif roll < 0.6:
            n = rng.randint(1, 64) * block_size + rng.choice((-2, -1, 0, 1, 2, 3))
        else:
            n = int(2 ** rng.uniform(4, 13))
        n = max(2, n)
        cached = 0
        if state.cache_mode == "align" and n > block_size + 3 and rng.random() < 0.3:
            cached = rng.randint(1, (n - 4) // block_size) * block_size
        cases.append(
            AuditCase(
                index=index,
                groups=(GroupShape(block_size=block_size), state),
                num_tokens=n,
                cached_prefix_tokens=cached,
                lookahead=producer.tokens,
                producer=producer,
                consumer=consumer,
            )
        )
    return cases


def _state_spec(g: GroupShape, page: int) -> MambaSpec:
    # Tiny conv and SSM tensors (every kind has both), padded to the attention page as vLLM pads them; "none"
    # mode's block is max_model_len.
    shapes = [(2, 2), (1, 4)]
    return MambaSpec(
        block_size=g.block_size if g.cache_mode == "align" else _MAX_MODEL_LEN,
        shapes=shapes,
        dtypes=["int8"] * len(shapes),
        page_size_padded=page,
        mamba_type=g.state,
        cache_mode=g.cache_mode,
        num_speculative_blocks=g.num_speculative_blocks,
    )


def _config(groups: Sequence[GroupShape], num_blocks: int) -> KVCacheConfig:
    # One byte per head element and one layer per group: pages are tiny, only block ids matter here.
    attention = [
        SlidingWindowSpec(block_size=g.block_size, num_kv_heads=1, head_size=2, dtype="int8", sliding_window=g.window)
        if g.window
        else FullAttentionSpec(block_size=g.block_size, num_kv_heads=1, head_size=2, dtype="int8")
        for g in groups
        if not g.state
    ]
    page = max(s.page_size_bytes for s in attention)
    it = iter(attention)
    specs = [_state_spec(g, page) if g.state else next(it) for g in groups]
    names = [f"g{i}" for i in range(len(groups))]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * page, layers=[n], layer_stride=0, block_stride=page) for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[n], kv_cache_spec=s) for n, s in zip(names, specs, strict=True)],
    )


# --------------------------------------------------------------------------- the drive


@attrs.define
class _Engine:
    """One engine: vLLM's KVCacheManager over the config, and its block hasher."""

    manager: Any
    hasher: Any


_MAX_MODEL_LEN = _MAX_TOKENS + 4096


def _engine(config: KVCacheConfig, block_size: int) -> _Engine:
    """vLLM's manager as its engine builds it: scheduler block size the lcm of the groups', hashes per block, or
    per scheduler block when a "none"-mode state group turns prefix caching off (``resolve_kv_cache_block_sizes``)."""
    caching = not any(
        isinstance(s, MambaSpec) and s.cache_mode == "none" for s in (g.kv_cache_spec for g in config.kv_cache_groups)
    )
    scheduler_block_size = math.lcm(*(g.kv_cache_spec.block_size for g in config.kv_cache_groups))
    hash_block_size = block_size if caching else scheduler_block_size
    kv_cache_manager = import_vllm("vllm.v1.core.kv_cache_manager")
    utils = import_vllm("vllm.v1.core.kv_cache_utils")
    hashing = import_vllm("vllm.utils.hashing")
    utils.init_none_hash(hashing.sha256)
    manager = kv_cache_manager.KVCacheManager(
        to_vllm_kv_cache_config(config),
        max_model_len=_MAX_MODEL_LEN,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        # vLLM turns prefix caching off with a state group in "none" mode (MambaModelConfig).
        enable_caching=caching,
    )
    return _Engine(manager=manager, hasher=utils.get_request_block_hasher(hash_block_size, hashing.sha256))


def _request(engine: _Engine, request_id: str, tokens: list[int], params: dict[str, Any] | None) -> Any:
    request_module = import_vllm("vllm.v1.request")
    sampling = import_vllm("vllm.sampling_params")
    extra = {"kv_transfer_params": params} if params is not None else None
    return request_module.Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=sampling.SamplingParams(max_tokens=1, extra_args=extra),
        pooling_params=None,
        block_hasher=engine.hasher,
    )


_CHUNK = 8192


def _prefill(engine: _Engine, request: Any, lookahead: int, start: int = 0, checkpoint: int = 0) -> None:
    """Compute the prompt in chunks, as the scheduler's prefill steps do.

    ``checkpoint`` (align-mode state groups): a chunk also ends there, as
    vLLM's ``_mamba_block_aligned_split`` ends one at the prefill checkpoint,
    so the state after that many tokens is cached (STATE-4).
    """
    done = start
    n = request.num_tokens
    while done < n:
        engine.manager.new_step_starts()
        step = min(_CHUNK, n - done)
        if done < checkpoint < done + step:
            step = checkpoint - done
        blocks = engine.manager.allocate_slots(request, step, num_lookahead_tokens=lookahead)
        if blocks is None:
            raise RuntimeError(f"vLLM's KVCacheManager has no room for {n} tokens")
        done += step
        request.num_computed_tokens = done


def _checkpoint(config: KVCacheConfig, num_tokens: int) -> int:
    """vLLM's prefill checkpoint for align-mode state groups (``get_mamba_prefill_checkpoint_position``); else 0."""
    aligned = [
        s.block_size
        for s in (g.kv_cache_spec for g in config.kv_cache_groups)
        if isinstance(s, MambaSpec) and s.cache_mode == "align"
    ]
    if not aligned:
        return 0
    interface = import_vllm("vllm.v1.kv_cache_interface")
    return int(interface.get_mamba_prefill_checkpoint_position(num_tokens, aligned[0], False))


def _warm_prefix(engine: _Engine, tokens: list[int], request_id: str, config: KVCacheConfig) -> None:
    """Run a request over ``tokens`` and free it, so its blocks stay in the prefix cache."""
    request = _request(engine, request_id, tokens, None)
    _prefill(engine, request, 0, checkpoint=_checkpoint(config, len(tokens)))
    engine.manager.free(request)


@attrs.frozen(kw_only=True)
class _Drive:
    """What one request left behind: both tables, the pairs, and the lists kvspec would see."""

    num_tokens: int
    prefix_hit_tokens: int
    first_computed: int
    producer_tokens: int = -1
    """The prompt tokens the producer computed (after vLLM's prefill backoff): its state has absorbed them (-1: not
    recorded, a drive built by hand without state groups)."""
    producer_table: tuple[tuple[int, ...], ...]
    consumer_table: tuple[tuple[int, ...], ...]
    producer_list: tuple[tuple[int, ...], ...]
    consumer_list: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[tuple[int, int], ...], ...] | None
    refusal: str | None = None
    failed_closed: str | None = None
    load_async: bool = True
    """Whether the consumer's load lands before the recomputing step (NIXL, Mooncake) or within it (MoRI-IO READ)."""


def _tuples(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in groups)


def _adapter(connector: str | VllmConnector) -> VllmConnector:
    """The vLLM connector a drive runs: ``reference`` drives NIXL's schedulers and kvspec's own pairing."""
    if isinstance(connector, VllmConnector):
        return connector
    return VllmConnector("nixl" if connector == "reference" else connector)


def _drive(
    case: AuditCase,
    connector: str | VllmConnector,
    configs: tuple[KVCacheConfig, KVCacheConfig],
    engines: tuple[_Engine, _Engine],
) -> _Drive:
    """One request: the producer engine on ``configs[0]``, the consumer on ``configs[1]`` (they differ only in the
    state groups' scratch slots, when the two engines run different speculation)."""
    producer_engine, consumer_engine = engines
    p_config, config = configs
    p_spec, c_spec = case.speculation("producer"), case.speculation("consumer")
    block_size = case.groups[0].block_size
    n = case.num_tokens
    rid = f"req{case.index}"
    # Distinct tokens per request: the only prefix hit is the one the case asks for.
    tokens = list(range(1 + case.index * (_MAX_TOKENS + 1), 1 + case.index * (_MAX_TOKENS + 1) + n))
    adapter = _adapter(connector)
    producer_sched = adapter.build_scheduler(
        p_config,
        role="kv_producer",
        mode=TransferMode.READ,
        num_lookahead_tokens=p_spec.tokens,
        num_prefill_lookahead_tokens=p_spec.prefill_lookahead if case.producer is not None else 0,
    )
    consumer_sched = adapter.build_scheduler(
        config,
        role="kv_consumer",
        mode=TransferMode.READ,
        num_lookahead_tokens=c_spec.tokens,
        num_prefill_lookahead_tokens=c_spec.prefill_lookahead if case.consumer is not None else 0,
    )
    hooks = adapter.shape(consumer_sched)
    # -- producer: the prefill leg
    p_params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": rid}
    p_req = _request(producer_engine, rid, tokens, p_params)
    if hasattr(producer_sched, "on_new_request"):
        producer_sched.on_new_request(p_req)
    p_manager = producer_engine.manager
    _, p_hit, *_ = p_manager.get_computed_blocks(p_req)
    producer_sched.get_num_new_matched_tokens(p_req, p_hit)
    _prefill(producer_engine, p_req, p_spec.tokens, checkpoint=_checkpoint(p_config, p_req.num_tokens))
    producer_tokens = p_req.num_computed_tokens
    request_status = import_vllm("vllm.v1.request").RequestStatus
    p_req.append_output_token_ids(7)
    p_req.status = request_status.FINISHED_LENGTH_CAPPED
    p_manager.remove_skipped_blocks(
        request_id=rid,
        processed_computed_tokens=max(0, p_req.num_computed_tokens - p_req.num_in_flight_tokens),
        num_prompt_tokens=p_req.num_prompt_tokens,
    )
    p_blocks = p_manager.get_block_ids_for_computed_tokens(
        request_id=rid, num_computed_tokens=p_req.num_computed_tokens
    )
    producer_table = _tuples(p_manager.get_block_ids(rid))
    _, returned = hooks.finish(producer_sched, p_req, p_blocks)
    if connector == "reference":
        remote_ids = _tuples(p_blocks)
    else:
        remote_ids = _tuples(hooks.sent_block_ids(producer_sched, rid, returned))
    p_manager.free(p_req)
    # -- consumer: the decode leg
    if case.cached_prefix_tokens:
        _warm_prefix(consumer_engine, tokens[: case.cached_prefix_tokens + block_size // 2], rid + "-warm", config)
    c_params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_block_ids": [list(g) for g in remote_ids],
        "remote_engine_id": "producer",
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": 0,
        "remote_bootstrap_addr": "127.0.0.1:0",
        "transfer_id": rid,
    }
    c_req = _request(consumer_engine, rid, tokens, c_params)
    if hasattr(consumer_sched, "on_new_request"):
        consumer_sched.on_new_request(c_req)
    c_manager = consumer_engine.manager
    c_manager.new_step_starts()
    computed_blocks, hit, *_ = c_manager.get_computed_blocks(c_req)
    # ``reference`` runs NIXL's consumer scheduler here, so its table is NIXL's: the asynchronous load
    # of N tokens, rolled back to N - 1 when it lands (the findings page's "same vLLM tables").
    external, load_async = consumer_sched.get_num_new_matched_tokens(c_req, hit)
    new_tokens = 0 if load_async else n - hit - external
    blocks = c_manager.allocate_slots(
        c_req,
        new_tokens,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed_blocks,
        num_lookahead_tokens=0 if load_async else c_spec.tokens,
        num_external_computed_tokens=external,
        delay_cache_blocks=load_async,
    )
    if blocks is None:
        raise RuntimeError(f"vLLM's KVCacheManager has no room for {n} tokens")
    consumer_table = _tuples(c_manager.get_block_ids(rid))
    loaded = hit + external
    first = min(loaded, n - 1)  # NIXL and Mooncake roll a full load back to N - 1
    refusal = failed_closed = None
    pairs: tuple[tuple[tuple[int, int], ...], ...] | None = None
    lists: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = (remote_ids, ())
    try:
        if connector == "reference" and hit < first:
            # The producer says how many tokens its state absorbed (protocol 1.2); the consumer resumes at `first`.
            check_state_position(config, state_tokens=producer_tokens, num_tokens=first)
        lists, pairs = _pair(
            connector, hooks, configs, consumer_sched, c_manager, c_req, remote_ids, external, first, hit
        )
    except KVSpecError as exc:
        if connector == "reference":
            # kvspec refuses before any byte moves, with a typed reason: the outcome WIN-1 prescribes.
            failed_closed, pairs = f"{type(exc).__name__}: {exc}", ()
        elif isinstance(exc, BlockAlignmentError):
            # The connector's own pairing code refused (a vLLM exception, or an error it logs and fails on).
            refusal = f"{type(exc).__name__}: {exc}"
        else:
            raise
    except (ValueError, AssertionError, RuntimeError, KeyError) as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    c_manager.free(c_req)
    return _Drive(
        num_tokens=n,
        prefix_hit_tokens=hit,
        first_computed=first,
        producer_tokens=producer_tokens,
        producer_table=producer_table,
        consumer_table=consumer_table,
        producer_list=lists[0],
        consumer_list=lists[1],
        pairs=pairs,
        refusal=refusal,
        failed_closed=failed_closed,
        load_async=bool(load_async),
    )


_Lists = tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


def _zip_pairs(
    producer: Sequence[Sequence[int]], consumer: Sequence[Sequence[int]]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple(zip(p, c, strict=True)) for p, c in zip(producer, consumer, strict=True))


def _pair(
    connector: str | VllmConnector,
    hooks: VllmHooks,
    configs: tuple[KVCacheConfig, KVCacheConfig],
    scheduler: Any,
    manager: Any,
    request: Any,
    remote: tuple[tuple[int, ...], ...],
    external: int,
    num_tokens: int,
    hit: int,
) -> tuple[_Lists, tuple[tuple[tuple[int, int], ...], ...]]:
    """The lists kvspec would be shown and the pairs the connector would post, from its own code.

    ``configs`` are the producer's and the consumer's; kvspec's reference clips each side's state lists by its own
    scratch count (STATE-2), and the connector pairs on the consumer's (its pairing reads only group kinds).
    """
    p_config, config = configs
    rid = request.request_id
    blocks = manager.get_blocks(rid)
    if connector == "reference":
        table = manager.get_block_ids(rid)
        _check_held(config, table, num_tokens, hit)
        budgets = get_blocks_per_sw(config)
        # A state group's whole list goes to kvspec's state clip (STATE-2); attention lists cover the tokens.
        producer = get_exchange_clipped_blocks(
            [
                g if is_state_spec(s.kv_cache_spec) else g[: -(-num_tokens // s.kv_cache_spec.block_size)]
                for g, s in zip(remote, config.kv_cache_groups, strict=True)
            ],
            budgets,
        )
        consumer = get_exchange_clipped_blocks(
            [
                t
                if is_state_spec(s.kv_cache_spec)
                else t[hit // s.kv_cache_spec.block_size : -(-num_tokens // s.kv_cache_spec.block_size)]
                for t, s in zip(table, config.kv_cache_groups, strict=True)
            ],
            budgets,
        )
        producer = get_state_clipped_blocks(p_config, BlockIds(producer))
        consumer = get_state_clipped_blocks(config, BlockIds(consumer))
        if hit >= num_tokens:
            return (_tuples(producer), ()), ()
        paired = compute_transfer_pairs(
            config,
            TransferRequest(
                num_tokens=num_tokens, prefix_hit_tokens=hit, producer_block_ids=producer, consumer_block_ids=consumer
            ),
        )
        return (_tuples(producer), _tuples(consumer)), _zip_pairs(paired.producer_block_ids, paired.consumer_block_ids)
    scheduler.update_state_after_alloc(request, blocks, external)
    shown, posted = hooks.audit_pairs(scheduler, config, rid, remote, manager.get_block_ids(rid), hit, external)
    return (_tuples(shown[0]), _tuples(shown[1])), _zip_pairs(posted[0], posted[1])


def _check_held(config: KVCacheConfig, table: Sequence[Sequence[int]], num_tokens: int, hit: int) -> None:
    """Refuse when the consumer nulled a block of its own prefix hit that token ``num_tokens`` attends (WIN-1).

    kvspec's ``check_window_coverage`` takes the hit as held; the reference consumer also reads its own
    table, as a conforming consumer can, so a hit block its engine nulled fails closed too.
    """
    for g, (group, ids) in enumerate(zip(config.kv_cache_groups, table, strict=True)):
        spec = group.kv_cache_spec
        if is_state_spec(spec):
            continue
        for k in get_needed_block_range(spec, num_tokens=num_tokens, prefix_hit_tokens=0):
            if k < hit // spec.block_size and (k >= len(ids) or ids[k] == NULL_BLOCK_ID):
                raise WindowCoverageError(
                    f"group {g}: logical block {k} of the consumer's prefix hit is needed by token {num_tokens} "
                    f"but is the null block on the consumer; expected a held block (WIN-1)"
                )


# --------------------------------------------------------------------------- the oracle


@attrs.frozen(kw_only=True)
class Finding:
    """One deviation of one request: its class, and the evidence (group, pair, logical blocks)."""

    deviation: str
    group: int
    detail: str
    pair: tuple[int, int] | None = None
    in_hit: bool = False
    """The block lies in the consumer's prefix hit, outside the lists a connector shows kvspec."""


def _logical(table: Sequence[int]) -> dict[int, int]:
    return {block_id: index for index, block_id in enumerate(table) if block_id != NULL_BLOCK_ID}


def check_drive(config: KVCacheConfig, drive: _Drive) -> list[Finding]:
    """Every way the pairs of ``drive`` break ALIGN-1, NULL-1 or WIN-1, judged by logical position (WIN-1)."""
    if drive.refusal is not None or drive.pairs is None:
        return [Finding(deviation="refused", group=-1, detail=drive.refusal or "no pairs")]
    if drive.failed_closed is not None:
        return []
    findings: list[Finding] = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        p_table, c_table = drive.producer_table[g], drive.consumer_table[g]
        p_index, c_index = _logical(p_table), _logical(c_table)
        pairs = drive.pairs[g] if g < len(drive.pairs) else ()
        if isinstance(spec, MambaSpec):
            findings += _check_state(g, spec, drive, pairs)
            continue
        held = drive.prefix_hit_tokens // spec.block_size
        arrives: dict[int, tuple[int, int]] = {}
        for p, c in pairs:
            if c == NULL_BLOCK_ID:
                findings.append(Finding(deviation="writes-null-block", group=g, detail="consumer id 0", pair=(p, c)))
                continue
            lc = c_index.get(c)
            if p == NULL_BLOCK_ID:
                arrives[lc if lc is not None else -1] = (p, c)
                if lc is not None and lc < held:
                    detail = f"consumer block {c} is logical {lc}, in the hit, and receives id 0"
                    findings.append(
                        Finding(deviation="null-into-cached-block", group=g, detail=detail, pair=(p, c), in_hit=True)
                    )
                continue
            lp = p_index.get(p)
            if lp != lc:
                findings.append(
                    Finding(
                        deviation="shifted-pair",
                        group=g,
                        detail=f"producer block {p} is logical {lp}, consumer block {c} is logical {lc}",
                        pair=(p, c),
                    )
                )
            if lc is not None:
                arrives[lc] = (p, c)
                if lc < held:
                    findings.append(
                        Finding(
                            deviation="writes-cached-prefix",
                            group=g,
                            detail=f"consumer block {c} is logical {lc}, in the hit",
                            pair=(p, c),
                            in_hit=True,
                        )
                    )
        # Every block the first computed token attends, whatever its source: the transfer, the
        # consumer's prefix hit, or a block the consumer nulled itself (WIN-1).
        for k in get_needed_block_range(spec, num_tokens=drive.first_computed, prefix_hit_tokens=0):
            in_hit = k < held
            span = f"logical block {k} (tokens {k * spec.block_size}..{(k + 1) * spec.block_size - 1})"
            span += " in the prefix hit" if in_hit else ""
            if k >= len(c_table) or c_table[k] == NULL_BLOCK_ID:
                findings.append(Finding(deviation="needed-block-null-on-consumer", group=g, detail=span, in_hit=in_hit))
            elif k in arrives and arrives[k][0] == NULL_BLOCK_ID:
                findings.append(
                    Finding(
                        deviation="reads-null-block",
                        group=g,
                        detail=span + " is read from id 0",
                        pair=arrives[k],
                        in_hit=in_hit,
                    )
                )
            elif not in_hit and k not in arrives:
                findings.append(Finding(deviation="needed-block-not-transferred", group=g, detail=span))
    return findings


def _state_slot(table: Sequence[int], spec: MambaSpec, tokens: int) -> int:
    """The slot of column ``(tokens - 1) // block_size`` of a state table: where the state after ``tokens`` is.

    vLLM's Mamba kernels write a prefill's state in the column of its last
    token; in "none" mode ``block_size`` is ``max_model_len``, so always
    column 0 (STATE-3, STATE-4).
    """
    column = (tokens - 1) // spec.block_size
    return table[column] if 0 <= column < len(table) else NULL_BLOCK_ID


def _column(table: Sequence[int], block: int) -> int:
    return table.index(block) if block in table else -1


def _check_state(g: int, spec: MambaSpec, drive: _Drive, pairs: Sequence[tuple[int, int]]) -> list[Finding]:
    """A state group's pairs against where the states are: P's state slot into C's resume slot (STATE-1 .. STATE-4).

    The consumer resumes at ``first_computed`` tokens; when that is within its
    prefix hit no state moves. Otherwise the producer's state must have
    absorbed exactly those tokens, and exactly one pair must join the slot
    holding it to the slot the consumer's kernel reads.
    """
    t = drive.first_computed
    if t == 0:
        return []  # the consumer computes from token 0: no kernel reads a state, whatever arrives
    if t <= drive.prefix_hit_tokens:
        return [
            Finding(deviation="writes-cached-prefix", group=g, detail=f"state slot {c} on a full hit", pair=(p, c))
            for p, c in pairs
        ]
    findings: list[Finding] = []
    if drive.producer_tokens != t:
        findings.append(
            Finding(
                deviation="state-position",
                group=g,
                detail=f"the producer's state has absorbed {drive.producer_tokens} tokens, the consumer resumes at {t}",
            )
        )
    source = _state_slot(drive.producer_table[g], spec, drive.producer_tokens)
    # The step that recomputes copies the state from column (t - 1) // B into the column of its last token,
    # then runs (vLLM's preprocess_mamba, before the connector's start_load_kv). A load that landed before that
    # step must fill the first; one that lands within it (MoRI-IO's synchronous READ) must fill the second.
    target = _state_slot(drive.consumer_table[g], spec, t if drive.load_async else drive.num_tokens)
    for p, c in pairs:
        if c == NULL_BLOCK_ID:
            findings.append(Finding(deviation="writes-null-block", group=g, detail="consumer id 0", pair=(p, c)))
        elif p == NULL_BLOCK_ID:
            findings.append(Finding(deviation="reads-null-block", group=g, detail="state read from id 0", pair=(p, c)))
        elif (
            p != source
            and c != target
            and _column(drive.producer_table[g], p) > _column(drive.producer_table[g], source) >= 0
        ):
            # A scratch slot into a slot the consumer does not resume from; into that slot it is a wrong state.
            findings.append(
                Finding(
                    deviation="state-scratch-travels",
                    group=g,
                    detail=f"producer slot {p} is a scratch slot after the state slot {source}",
                    pair=(p, c),
                )
            )
        elif p != source or c != target:
            scratch = _column(drive.producer_table[g], p) > _column(drive.producer_table[g], source) >= 0
            findings.append(
                Finding(
                    deviation="state-wrong-slot",
                    group=g,
                    detail=("a scratch slot; " if scratch else "")
                    + f"expected slot {source} (P, state after {drive.producer_tokens} tokens) into slot "
                    f"{target} (C, resumes at {t})",
                    pair=(p, c),
                )
            )
    if target != NULL_BLOCK_ID and all(c != target for _, c in pairs):
        findings.append(
            Finding(
                deviation="state-not-transferred",
                group=g,
                detail=f"consumer slot {target} (resumes at {t}) receives no state",
            )
        )
    return findings


def _ends(lists: Sequence[Sequence[int]], tables: Sequence[Sequence[int]]) -> tuple[int, ...] | None:
    """The logical block just past each list's last entry, read from the side's table; None if unknowable."""
    ends = []
    for group, table in zip(lists, tables, strict=True):
        index = _logical(table)
        last = next(((j, b) for j, b in reversed(list(enumerate(group))) if b != NULL_BLOCK_ID), None)
        if last is None or last[1] not in index:
            return None
        ends.append(index[last[1]] + len(group) - last[0])
    return tuple(ends)


def check_kvspec(config: KVCacheConfig, drive: _Drive, findings: Sequence[Finding]) -> list[Finding]:
    """Does kvspec's own check agree with the oracle on the lists the connector paired (WIN-1, ALIGN-1)?"""
    if drive.refusal is not None or drive.failed_closed is not None or not any(drive.consumer_list):
        return []
    # Pairs into the prefix hit are not built from the lists kvspec is shown (those start at the hit).
    wrong = any(f.deviation in ("shifted-pair", "reads-null-block") and not f.in_hit for f in findings)
    # What a protocol 1.1 connector states: its lists cover the N tokens they were built for (the consumer
    # recomputes the last ones), and each list ends where it ends in its side's table.
    arguments: dict[str, Any] = {
        "num_tokens": drive.first_computed,
        "prefix_hit_tokens": drive.prefix_hit_tokens,
        "producer_block_ids": BlockIds(drive.producer_list),
        "consumer_block_ids": BlockIds(drive.consumer_list),
        "recomputed_tokens": drive.num_tokens - drive.first_computed,
        "producer_block_ends": _ends(drive.producer_list, drive.producer_table),
        "consumer_block_ends": _ends(drive.consumer_list, drive.consumer_table),
    }
    try:
        request = TransferRequest(**arguments)
        check_window_coverage(config, request)
        compute_transfer_pairs(config, request)
    except KVSpecError as exc:
        if findings:
            return []
        return [Finding(deviation="kvspec-refuses-correct-lists", group=-1, detail=f"{type(exc).__name__}: {exc}")]
    if wrong:
        return [
            Finding(deviation="kvspec-accepts-wrong-lists", group=-1, detail="check_window_coverage and pairing pass")
        ]
    return []


# --------------------------------------------------------------------------- the report


@attrs.frozen(kw_only=True)
class ClassResult:
    """One deviation class on one connector: how many requests, how many bad pairs, the smallest reproducer."""

    connector: str
    deviation: str
    requests: int
    findings: int
    reproducer: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready."""
        d = DEVIATIONS[self.deviation]
        return {
            "connector": self.connector,
            "class": self.deviation,
            "rule": d.rule,
            "title": d.title,
            "consequence": d.consequence,
            "requests": self.requests,
            "findings": self.findings,
            "reproducer": self.reproducer,
        }


@attrs.frozen(kw_only=True)
class AuditReport:
    """What ``kvspec vllm-audit`` found: per connector, requests checked, pairs posted, and each deviation class."""

    seed: int
    vllm_version: str
    requests: dict[str, int]
    """Requests driven per connector, state-group requests included."""
    pairs: dict[str, int]
    failed_closed: dict[str, int]
    classes: tuple[ClassResult, ...]
    seconds: float
    connector_classes: dict[str, str] = attrs.field(factory=dict)
    """Each audited connector's vLLM class as ``MODULE:CLASS``, by the label the report uses."""
    state_requests: int = 0
    """How many of each connector's requests run on FA + state-group configs."""
    speculation_requests: int = 0
    """How many of each connector's requests run different speculation on the two engines (FA + state group)."""

    def deviations(self, connector: str | None = None) -> int:
        """Requests with a deviation, over the classes kvspec counts as such (not its own strictness)."""
        return sum(
            c.requests
            for c in self.classes
            if (connector is None or c.connector == connector) and not c.deviation.startswith("kvspec-")
        )

    def to_dict(self) -> dict[str, object]:
        """The committed JSON's content; ``seconds`` is left out so a rerun at the same seed matches."""
        return {
            "vllm_version": self.vllm_version,
            "connector_classes": self.connector_classes,
            "seed": self.seed,
            "requests": self.requests,
            "state_requests": self.state_requests,
            "speculation_requests": self.speculation_requests,
            "pairs": self.pairs,
            "failed_closed": self.failed_closed,
            "classes": [c.to_dict() for c in self.classes],
        }

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def _tested_lines(self) -> list[str]:
        import kvspec

        version = ".".join(map(str, kvspec.PROTOCOL_VERSION))
        lines = [f"  kvspec {kvspec.__version__}, protocol version {version}"]
        lines += [f"  {name}: {path}" for name, path in self.connector_classes.items() if name != path]
        return lines

    def render(self) -> str:
        """The terminal table, then the smallest reproducer of each class."""
        lines = [
            f"kvspec vllm-audit: vLLM {self.vllm_version}, seed {self.seed}, {self.seconds:.1f}s, "
            f"{self.state_requests} of each connector's requests on state-group configs, "
            f"{self.speculation_requests} with different speculation on the two engines"
        ]
        lines += [*self._tested_lines(), ""]
        width = max([10, *(len(name) for name in self.requests)])
        header = (
            f"{'connector':<{width}} {'requests':>8} {'pairs':>9} {'refused':>7}  "
            f"{'deviation class':<30} {'rule':<8} {'requests':>8} {'pairs':>7}"
        )
        lines += [header, "-" * len(header)]
        for connector, count in self.requests.items():
            mine = [c for c in self.classes if c.connector == connector]
            first = f"{connector:<{width}} {count:>8} {self.pairs[connector]:>9} {self.failed_closed[connector]:>7}  "
            if not mine:
                lines.append(first + "no deviation")
            for i, c in enumerate(mine):
                prefix = first if i == 0 else " " * len(first)
                rule = DEVIATIONS[c.deviation].rule
                lines.append(prefix + f"{c.deviation:<30} {rule:<8} {c.requests:>8} {c.findings:>7}")
        for c in self.classes:
            r = c.reproducer
            lines += [
                "",
                f"{c.connector} {c.deviation} ({DEVIATIONS[c.deviation].rule}): {DEVIATIONS[c.deviation].title}",
                f"  config {r['groups']}, N={r['num_tokens']}, H={r['prefix_hit_tokens']}, "
                + (f"speculation {r['speculation']}" if r.get("speculation") else f"lookahead={r['lookahead']}")
                + f", first computed token {r['first_computed']}",
                f"  group {r['group']}: {r['detail']}" + (f", pair {r['pair']}" if r.get("pair") else ""),
                f"  producer list {r['producer_list']}",
                f"  consumer list {r['consumer_list']}",
            ]
        return "\n".join(lines) + "\n"


def check_expected(report: AuditReport, expected: Mapping[str, str]) -> list[str]:
    """What breaks the expected list: a deviation class not in it, or a listed one that is gone (FAIL-1).

    Keys are ``CONNECTOR/CLASS`` or ``CLASS`` (any connector), as
    :func:`kvspec.integrations.expectations.parse_expected` reads them; keys
    naming a connector not in ``report`` are ignored. kvspec's own
    strictness classes (``kvspec-*``) are never counted.
    """
    problems = []
    found = {(c.connector, c.deviation) for c in report.classes if not c.deviation.startswith("kvspec-")}
    for connector, deviation in sorted(found, key=lambda k: (list(report.requests).index(k[0]), k[1])):
        if f"{connector}/{deviation}" not in expected and deviation not in expected:
            rule = DEVIATIONS[deviation].rule
            problems.append(f"{connector}: unexpected deviation {deviation} ({rule}): {DEVIATIONS[deviation].title}")
    for key, reason in expected.items():
        connector, _, deviation = key.rpartition("/")
        if deviation not in DEVIATIONS:
            problems.append(f"expected {key}: no deviation class {deviation!r}; expected one of {sorted(DEVIATIONS)}")
            continue
        audited = [connector] if connector else list(report.requests)
        if connector and connector not in report.requests:
            continue
        if not any((name, deviation) in found for name in audited):
            problems.append(
                f"{key} was expected ({reason}) but no longer found: the deviation is gone, remove it from the list"
            )
    return problems


def _clip_list(groups: Sequence[Sequence[int]], limit: int = 12) -> list[list[int] | str]:
    out: list[list[int] | str] = []
    for g in groups:
        out.append(list(g) if len(g) <= limit else f"{len(g)} ids ending {list(g[-limit:])}")
    return out


def _reproducer(case: AuditCase, drive: _Drive, finding: Finding) -> dict[str, object]:
    return {
        **case.to_dict(),
        "prefix_hit_tokens": drive.prefix_hit_tokens,
        "first_computed": drive.first_computed,
        "group": finding.group,
        "detail": finding.detail.splitlines()[0][:300],
        "pair": list(finding.pair) if finding.pair else None,
        "producer_list": _clip_list(drive.producer_list),
        "consumer_list": _clip_list(drive.consumer_list),
    }


def _size(case: AuditCase) -> tuple[int, int, int]:
    return (case.num_tokens, case.lookahead, case.index)


def audit_case(case: AuditCase, connector: str | VllmConnector) -> tuple[_Drive, list[Finding]]:
    """Drive one request through ``connector`` and vLLM's own managers; every finding of the oracle (WIN-1)."""
    block_size = case.groups[0].block_size
    # Pools sized to the request, so building vLLM's managers costs in proportion to it.
    lookahead = max(case.speculation("producer").tokens, case.speculation("consumer").tokens)
    per_group = -(-(case.num_tokens + lookahead) // block_size) + 4
    num_blocks = len(case.groups) * per_group + 16
    p_config = _config(case.side_groups("producer"), num_blocks)
    config = _config(case.side_groups("consumer"), num_blocks)
    engines = (_engine(p_config, block_size), _engine(config, block_size))
    drive = _drive(case, connector, (p_config, config), engines)
    findings = check_drive(config, drive)
    return drive, findings + check_kvspec(config, drive, findings)


def run_audit(
    *,
    connectors: Sequence[str | VllmConnector] = ("moriio", "nixl", "mooncake"),
    requests: int = 100,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    state_requests: int | None = None,
    speculation_requests: int | None = None,
) -> AuditReport:
    """Drive ``requests`` random requests through each connector and vLLM's managers; classify every deviation (WIN-1).

    ``requests`` attention requests (:func:`generate_cases`), then
    ``state_requests`` (default ``requests // 4``) on FA + state-group configs
    (:func:`generate_state_cases`, STATE-1 .. STATE-4), then
    ``speculation_requests`` (default ``requests // 10``) whose two engines
    run different speculation (:func:`generate_speculation_cases`); the same
    requests go through every connector. ``"reference"`` runs
    kvspec's own clipping and pairing on the same vLLM tables; a
    ``MODULE:CLASS`` string or a :class:`~kvspec.integrations.vllm.VllmConnector`
    audits any vLLM connector class (labelled by its name).
    """
    adapters: dict[str, str | VllmConnector] = {}
    for connector in connectors:
        if isinstance(connector, str) and connector not in AUDIT_CONNECTORS and ":" not in connector:
            raise ValueError(
                f"vllm-audit: connector expected one of {list(AUDIT_CONNECTORS)} or MODULE:CLASS, got {connector!r}"
            )
        label = connector if isinstance(connector, str) else connector.name
        adapters[label] = VllmConnector(connector) if ":" in label and isinstance(connector, str) else connector
    labels = list(adapters)
    started = time.perf_counter()
    state_count = requests // 4 if state_requests is None else state_requests
    speculation_count = requests // 10 if speculation_requests is None else speculation_requests
    cases = [
        *generate_cases(requests, seed),
        *generate_state_cases(state_count, seed, first_index=requests),
        *generate_speculation_cases(speculation_count, seed, first_index=requests + state_count),
    ]
    counts = dict.fromkeys(labels, 0)
    pairs = dict.fromkeys(labels, 0)
    closed = dict.fromkeys(labels, 0)
    found: dict[tuple[str, str], list[tuple[AuditCase, _Drive, Finding, int]]] = {}
    for step, case in enumerate(cases):
        for name, adapter in adapters.items():
            drive, findings = audit_case(case, adapter)
            counts[name] += 1
            pairs[name] += sum(len(g) for g in drive.pairs or ())
            closed[name] += drive.failed_closed is not None
            by_class: dict[str, list[Finding]] = {}
            for f in findings:
                by_class.setdefault(f.deviation, []).append(f)
            for deviation, items in by_class.items():
                found.setdefault((name, deviation), []).append((case, drive, items[0], len(items)))
        if progress is not None:
            progress(step + 1, len(cases))
    order = {d: i for i, d in enumerate(DEVIATIONS)}
    classes = []
    for (name, deviation), hits in sorted(found.items(), key=lambda kv: (labels.index(kv[0][0]), order[kv[0][1]])):
        case, drive, finding, _ = min(hits, key=lambda h: _size(h[0]))
        classes.append(
            ClassResult(
                connector=name,
                deviation=deviation,
                requests=len(hits),
                findings=sum(h[3] for h in hits),
                reproducer=_reproducer(case, drive, finding),
            )
        )
    return AuditReport(
        seed=seed,
        vllm_version=installed_vllm_version() or "not installed",
        connector_classes={
            name: "kvspec reference functions" if name == "reference" else _adapter(adapter).connector_class
            for name, adapter in adapters.items()
        },
        requests=counts,
        pairs=pairs,
        failed_closed=closed,
        classes=tuple(classes),
        seconds=time.perf_counter() - started,
        state_requests=state_count,
        speculation_requests=speculation_count,
    )
