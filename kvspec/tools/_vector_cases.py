"""The vector cases: hand-picked pins and boundaries per rule, seeded generated ones, and the writer.

Each :class:`CaseSet` says which vectors one rule gets for one function: its
pinned cases (every value and boundary the spec names) and a generator of
random inputs. Inputs are kvspec values; :func:`build_vectors` encodes them,
decodes them back (so the decoder is exercised) and asks the reference for
the expected answer. ``random.Random`` is seeded from the seed, rule and
function, so the same kvspec version and seed write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec.core._errors import ConfigError
from kvspec.core._models import (
    BlockIds,
    CacheDeclaration,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FailureReason,
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
from kvspec.core._rules import RULES
from kvspec.protocol._codec import decode, encode
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._plan import plan_transfer
from kvspec.protocol._session import ConsumerSession, ProducerSession
from kvspec.protocol._summary import blocks_needed_for, summarize_plan
from kvspec.reference._messages import (
    PROTOCOL_VERSION,
    Abort,
    BlockOffer,
    Completion,
    EngineDescriptor,
    Failure,
    GroupDescriptor,
    Release,
    ReleaseOutcome,
    TransferParams,
)
from kvspec.reference._offload import (
    OffloadConfig,
    check_offload_support,
    get_chunk_sizes,
    get_load_set,
    get_offload_hit_tokens,
    get_offload_keys,
    get_retained_chunk_starts,
    get_store_set,
    get_sub_block_offset,
    map_sub_blocks,
)
from kvspec.reference._reference import (
    check_hybrid_support,
    check_window_coverage,
    compute_block_pairs,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_needed_block_range,
    get_needed_token_range,
    get_num_skipped_tokens,
    get_pruned_block_ids,
    get_token_basis_group,
    is_full_attention_spec,
    is_hma_required,
)
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.digest import DigestPolicy, digest_rank_page, is_request_sampled
from kvspec.spec.guard import check_request_blocks
from kvspec.spec.parallel import (
    CanonicalPage,
    PageTensor,
    ParallelLayout,
    RankCopy,
    RankLayout,
    SubBlock,
    check_coverage,
    check_page_sliceable,
    compute_dcp_copies,
    compute_rank_copies,
    elect_source_rank,
    get_completion_count,
    get_dcp_token_position,
    get_layout_mismatch,
    get_owned_units,
    get_rank_page_map,
    pair_stage_layers,
)
from kvspec.spec.pins import Pin, pins_for
from kvspec.spec.state import (
    check_state_position,
    check_state_prefix_hit,
    get_state_clipped_blocks,
    get_state_differences,
    get_state_prefix_hit,
    pair_state_slots,
)
from kvspec.tools._vectors import (
    FORMAT_VERSION,
    FUNCTIONS,
    PUBLIC_NAMES,
    Json,
    answer_schema,
    answer_vector,
    to_json,
    vector_schema,
)

__all__ = [
    "CASE_SETS",
    "DEFAULT_COUNT",
    "DEFAULT_SEED",
    "Case",
    "CaseSet",
    "build_archive",
    "build_vectors",
    "dumps_json",
    "write_vectors",
]

DEFAULT_COUNT = 4
"""Generated vectors per (rule, function) when ``--count`` is not given."""

DEFAULT_SEED = 0
"""Seed when ``--seed`` is not given."""

MANIFEST = "manifest.json"


@attrs.frozen(kw_only=True)
class Case:
    """One vector's name, its inputs as kvspec values, and an optional one-line description."""

    name: str
    inputs: Mapping[str, object]
    description: str = ""


@attrs.frozen(kw_only=True)
class CaseSet:
    """The vectors one rule gets for one function: pinned cases and a generator of random ones."""

    rule: str
    fn: object
    pinned: Callable[[], Sequence[Case]]
    generate: Callable[[random.Random], Mapping[str, object]] | None = None

    @property
    def function(self) -> str:
        """The function's public name, from :data:`kvspec.tools._vectors.PUBLIC_NAMES` (one line per rename)."""
        return PUBLIC_NAMES[self.fn]


# --------------------------------------------------------------------------- building blocks


def _full(block_size: int = 16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype="float16", **kw)


def _chunked(chunk: int, block_size: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=4, dtype="float16", attention_chunk_size=chunk
    )


def _sw(window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype="float16", sliding_window=window)


def _config(
    specs: Sequence[KVCacheSpec], *, num_blocks: int = 64, layers: int = 1, layout: str = "blocks_first"
) -> KVCacheConfig:
    """One tensor per group: ``blocks_first`` (a block's pages of every layer adjacent) or ``layers_first``."""
    groups, tensors = [], []
    for g, spec in enumerate(specs):
        names = [f"layers.{g}.{i}" for i in range(layers)]
        page = spec.page_size_bytes
        if layout == "blocks_first":
            tensor = KVCacheTensor(
                size=num_blocks * layers * page, layers=names, layer_stride=page, block_stride=layers * page
            )
        else:
            tensor = KVCacheTensor(
                size=num_blocks * layers * page, layers=names, layer_stride=num_blocks * page, block_stride=page
            )
        tensors.append(tensor)
        groups.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


_KINDS = ("full", "mla", "sw", "sw_mla", "chunked", "indexer", "cross", "mamba", "unknown")


def _rand_spec(rng: random.Random, kinds: Sequence[str] = ("full", "sw")) -> KVCacheSpec:
    block = rng.choice([4, 8, 16])
    common: dict[str, Any] = {
        "block_size": block,
        "num_kv_heads": rng.choice([1, 2]),
        "head_size": rng.choice([4, 8]),
        "dtype": rng.choice(["float16", "bfloat16", "float32", "fp8"]),
    }
    window = rng.choice([block, 2 * block, 3 * block - 1, rng.randint(1, 5 * block)])
    kind = rng.choice(kinds)
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "mla":
        return MLAAttentionSpec(**common)
    if kind == "sw":
        return SlidingWindowSpec(**common, sliding_window=window)
    if kind == "sw_mla":
        return SlidingWindowMLASpec(**common, sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    if kind == "indexer":
        return IndexerSpec(**{**common, "num_kv_heads": 1, "dtype": "uint8"})
    if kind == "cross":
        return CrossAttentionSpec(**common)
    if kind == "mamba":
        return MambaSpec(block_size=block, shapes=[[2, rng.choice([2, 4])]], dtypes=["float32"])
    if kind == "mamba_align":  # pins only: a state group offload admits (OFF-9)
        return MambaSpec(block_size=block, shapes=[[2, 2]], dtypes=["float32"], cache_mode="align")
    return KVCacheSpec(block_size=block, page_size_padded=64)


def _rand_config(rng: random.Random, kinds: Sequence[str] = ("full", "sw"), *, num_blocks: int = 64) -> KVCacheConfig:
    specs = [_rand_spec(rng, kinds) for _ in range(rng.randint(1, 3))]
    return _config(
        specs, num_blocks=num_blocks, layers=rng.randint(1, 2), layout=rng.choice(["blocks_first", "layers_first"])
    )


def _rand_ids(rng: random.Random, groups: int, *, most: int = 6, null: float = 0.0) -> list[list[int]]:
    return [
        [0 if rng.random() < null else rng.randint(1, 60) for _ in range(rng.randint(0, most))] for _ in range(groups)
    ]


def _table(config: KVCacheConfig, num_tokens: int, rng: random.Random | None = None) -> BlockIds:
    """A full block table for ``num_tokens``, ids distinct across groups (shuffled when ``rng`` is given)."""
    counts = [-(-num_tokens // g.kv_cache_spec.block_size) for g in config.kv_cache_groups]
    pool = list(range(1, config.num_blocks))
    if rng is not None:
        rng.shuffle(pool)
    groups, start = [], 0
    for n in counts:
        groups.append(pool[start : start + n])
        start += n
    return BlockIds(groups)


def _exchange(
    config: KVCacheConfig, num_tokens: int, prefix_hit: int, rng: random.Random | None = None
) -> dict[str, object]:
    """What a sound exchange passes: P's pruned, clipped table and C's clipped uncached suffix (WIN-1, CLIP-1)."""
    producer = get_exchange_clipped_blocks(
        get_pruned_block_ids(config, _table(config, num_tokens, rng), num_computed_tokens=num_tokens),
        get_blocks_per_sw(config),
    )
    counts = get_consumer_block_counts(config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit)
    pool = list(range(1, config.num_blocks))
    if rng is not None:
        rng.shuffle(pool)
    consumer, start = [], 0
    for n in counts:
        consumer.append(pool[start : start + n])
        start += n
    return {
        "config": config,
        "num_tokens": num_tokens,
        "prefix_hit_tokens": prefix_hit,
        "producer_block_ids": producer,
        "consumer_block_ids": BlockIds(consumer) if prefix_hit < num_tokens else BlockIds([]),
    }


def _rand_exchange(rng: random.Random, *, mutate: bool = True) -> dict[str, object]:
    config = _rand_config(rng, num_blocks=128)
    block = max(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
    lcm = 16  # every generated block size divides 16, so H stays whole blocks in every group
    num_tokens = rng.randint(1, 6 * block)
    prefix_hit = rng.randint(0, num_tokens // lcm) * lcm
    case = _exchange(config, num_tokens, prefix_hit, rng)
    if mutate and rng.random() < 0.4:
        role = rng.choice(["producer_block_ids", "consumer_block_ids"])
        ids = [list(g) for g in case[role]]  # type: ignore[attr-defined]
        nonempty = [g for g in ids if g]
        if nonempty:
            group = rng.choice(nonempty)
            if rng.random() < 0.5:
                group[rng.randrange(len(group))] = 0  # a null where a block may be needed (WIN-1)
            else:
                del group[0]  # one block short
            case[role] = BlockIds(ids)
    return case


# --------------------------------------------------------------------------- HMA-1, ADM-1, ADM-2

_FLAG = "disable_hybrid_kv_cache_manager"


def _kinds_config(*kinds: str) -> KVCacheConfig:
    rng = random.Random(0)  # fixed shapes for pinned cases
    specs = []
    for kind in kinds:
        spec = _rand_spec(rng, (kind,))
        specs.append(_sw(32) if kind == "sw" else _full() if kind == "full" else spec)
    return _config(specs, num_blocks=8)


def _hma_pins() -> list[Case]:
    fa_window = _config([_full(sliding_window=32)], num_blocks=8)
    return [
        *_table_cases("HMA-1", "is_hma_required"),
        Case(
            name="full_with_window_hma_off_form",
            inputs={"config": fa_window, _FLAG: False},
            description="vLLM's HMA-off form: a full-attention spec with a window set is full attention",
        ),
    ]


def _full_attention_pins() -> list[Case]:
    rng = random.Random(0)
    cases = [Case(name=f"kind_{kind}", inputs={"spec": _rand_spec(rng, (kind,))}) for kind in _KINDS]
    cases.append(Case(name="full_with_window", inputs={"spec": _full(sliding_window=32)}))
    return cases


def _gen_admission(rng: random.Random) -> dict[str, object]:
    return {
        "config": _rand_config(rng, _KINDS, num_blocks=8),
        "mode": rng.choice(["read", "write"]),
        "read_only_hma": rng.random() < 0.3,
        _FLAG: rng.random() < 0.2,
    }


# --------------------------------------------------------------------------- the pins table (kvspec.spec.pins)


def _pin_inputs(pin: Pin) -> dict[str, object]:
    """A pin's plain inputs as the kvspec values its function takes (the conventions of kvspec.spec.pins)."""
    given: Mapping[str, Any] = pin.inputs
    if "kinds" in given:  # HMA-1, ADM-1, ADM-2, OFF-9
        return {"config": _kinds_config(*given["kinds"]), **{k: v for k, v in given.items() if k != "kinds"}}
    if pin.rule == "SW-1":
        return {"config": _config([_sw(given["window"], given["block_size"])], num_blocks=4)}
    if pin.rule == "CLIP-1":
        return _clip(given["block_ids"], given["budgets"])
    if pin.rule in ("ALIGN-1", "NULL-1"):
        return _pairs(given["producer_block_ids"], given["consumer_block_ids"])
    if pin.rule == "WIN-1":
        window, block = given["window"], given["block_size"]
        spec = _full(block) if window is None else _sw(window, block)
        return _spec_tokens(spec, given["num_tokens"], given["prefix_hit_tokens"])
    if "groups" in given:  # OFF-1, OFF-5, OFF-8: full attention and window groups, 64 blocks
        groups = given["groups"]
        config = _config([_pin_group(g) for g in groups])
        f = given["blocks_per_chunk"]
        if pin.rule == "OFF-1":
            return {"config": config, "blocks_per_chunk": f, "hash_block_size": given["hash_block_size"]}
        if pin.rule == "OFF-8":
            return {"config": config, "num_computed_tokens": given["num_computed_tokens"], "offload": _offload(f)}
        return _hit(config, given["present"], given["num_tokens"], given["local_hit_tokens"], f)
    if pin.rule == "OFF-7":
        return dict(given)
    raise ConfigError(f"vectors: pins: rule {pin.rule!r} has no input convention")  # pragma: no cover


def _pin_group(group: Mapping[str, Any]) -> KVCacheSpec:
    """One pinned group: full attention, a window, or (``"state": true``) an align-mode Mamba-2 state group."""
    if group.get("state"):
        return MambaSpec(block_size=group["block_size"], shapes=[[2, 2]], dtypes=["float32"], cache_mode="align")
    return _full(group["block_size"]) if group["window"] is None else _sw(group["window"], group["block_size"])


def _table_cases(rule: str, function: str) -> list[Case]:
    """The pinned cases of one rule and function, one per row of the pins table."""
    return [Case(name=p.name, inputs=_pin_inputs(p), description=p.description) for p in pins_for(rule, function)]


def _pinned(rule: str, function: str) -> Callable[[], list[Case]]:
    return lambda: _table_cases(rule, function)


# --------------------------------------------------------------------------- SW-1, CLIP-1, TOK-1


def _sw1_pins() -> list[Case]:
    cases = _table_cases("SW-1", "get_blocks_per_sw")
    cases.append(
        Case(
            name="worked_example",
            inputs={"config": _worked_config()},
            description="docs/explanation/worked-example.md: SW(W=48) first, then FA: (4, 0)",
        )
    )
    cases.append(
        Case(
            name="per_group_block_size",
            inputs={"config": _config([_sw(32, 8), _full(16), _sw(128, 32)], num_blocks=4)},
            description="each group with its own block size; full attention 0",
        )
    )
    for chunk, block, budget in ((8192, 16, 512), (32, 16, 2), (40, 16, 3), (24, 16, 3), (7, 4, 3)):
        cases.append(
            Case(
                name=f"with_chunked_local_c{chunk}_b{block}",
                inputs={"config": _config([_full(block), _chunked(chunk, block)], num_blocks=4)},
                description=f"CACHE-1: a chunk's blocks, (C + B - gcd(C, B) - 1) // B + 1 = {budget}; "
                "never a window's cdiv(C, B) + 1",
            )
        )
    return cases


def _clip(ids: Sequence[Sequence[int]], budgets: Sequence[int]) -> dict[str, object]:
    return {"block_ids": BlockIds(ids), "budgets": tuple(budgets)}


def _gen_clip(rng: random.Random) -> dict[str, object]:
    groups = rng.randint(0, 3)
    budgets = [rng.choice([0, 0, 1, 2, 3, 9]) for _ in range(groups if rng.random() < 0.9 else groups + 1)]
    return _clip(_rand_ids(rng, groups, most=10), budgets)


def _token_basis_pins() -> list[Case]:
    return [
        Case(name="sliding_first", inputs={"config": _kinds_config("sw", "full")}, description="Gemma order: index 1"),
        Case(name="full_first", inputs={"config": _kinds_config("full", "sw")}),
        Case(name="no_full_attention", inputs={"config": _kinds_config("sw")}, description="null"),
        Case(name="mla", inputs={"config": _kinds_config("sw_mla", "mla")}, description="MLA counts as full"),
        Case(name="worked_example", inputs={"config": _worked_config()}, description="group 1, block size 16"),
    ]


def _params(**overrides: Any) -> TransferParams:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "producer_engine_id": "P",
        "producer_block_ids": [[1, 2, 3], [4, 5]],
        "num_tokens": 40,
        "mode": TransferMode.READ,
        "lease_deadline": 30.0,
        "transport_data": {"remote_host": "127.0.0.1", "remote_port": 5600},
    }
    fields.update(overrides)
    return TransferParams(**fields)


def _tok_dict_pins() -> list[Case]:
    good = _params().to_kv_transfer_params()
    bad_version = {**good, "kvspec_version": "2.0"}
    no_tokens = {k: v for k, v in good.items() if k != "remote_num_tokens"}
    return [
        Case(name="explicit_num_tokens", inputs={"kv_transfer_params": good}, description="TOK-1: T travels"),
        Case(name="missing_num_tokens", inputs={"kv_transfer_params": no_tokens}, description="never inferred"),
        Case(name="push_alias", inputs={"kv_transfer_params": {**good, "transfer_mode": "push"}}),
        Case(name="other_major", inputs={"kv_transfer_params": bad_version}),
        Case(name="flat_block_list", inputs={"kv_transfer_params": {**good, "remote_block_ids": [1, 2, 3]}}),
    ]


def _tok_to_dict_pins() -> list[Case]:
    return [
        Case(name="named_transport", inputs={"message": _params()}),
        Case(name="opaque_transport", inputs={"message": _params(transport_data=b"\x00agent")}),
    ]


# --------------------------------------------------------------------------- ALIGN-1, NULL-1


def _pairs(p: Sequence[Sequence[int]], c: Sequence[Sequence[int]]) -> dict[str, object]:
    return {"producer_block_ids": BlockIds(p), "consumer_block_ids": BlockIds(c)}


def _gen_align(rng: random.Random) -> dict[str, object]:
    groups = rng.randint(1, 3)
    producer = _rand_ids(rng, groups, most=8, null=0.15)
    consumer = []
    for g in producer:
        n = rng.randint(0, len(g) + (1 if rng.random() < 0.15 else 0))
        consumer.append([0 if rng.random() < 0.1 else rng.randint(1, 60) for _ in range(n)])
    if rng.random() < 0.1:
        consumer = consumer[:-1] if rng.random() < 0.5 else []
    return _pairs(producer, consumer)


def _plan_null_pins() -> list[Case]:
    config = _config([_full(), _sw(32)], num_blocks=16)
    return [
        Case(
            name="null_block_in_a_pair",
            inputs={"producer_config": config, "consumer_config": config, **_pairs([[1, 2], [0]], [[3, 4], [5]])},
            description="the planner refuses a null id in a pair",
        )
    ]


# --------------------------------------------------------------------------- WIN-1


def _spec_tokens(spec: KVCacheSpec, t: int, h: int = 0) -> dict[str, object]:
    return {"spec": spec, "num_tokens": t, "prefix_hit_tokens": h}


def _gen_range(rng: random.Random) -> dict[str, object]:
    spec = _rand_spec(rng)
    t = rng.randint(0, 8 * spec.block_size)
    return _spec_tokens(spec, t, rng.randint(0, t))


def _count_pins() -> list[Case]:
    return [
        Case(name="exact_blocks", inputs={"spec": _full(), "num_tokens": 32}),
        Case(name="partial_block", inputs={"spec": _full(), "num_tokens": 33}),
        Case(name="zero", inputs={"spec": _full(), "num_tokens": 0}),
        Case(name="negative", inputs={"spec": _full(), "num_tokens": -1}),
    ]


def _skipped_pins() -> list[Case]:
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=4, dtype="fp16", attention_chunk_size=64
    )
    mamba = MambaSpec(block_size=16, shapes=[[2, 2]], dtypes=["float32"])
    return [
        Case(name="sliding_w32_n47", inputs={"spec": _sw(32), "num_computed_tokens": 47}),
        Case(name="sliding_w32_n31", inputs={"spec": _sw(32), "num_computed_tokens": 31}),
        Case(name="full_attention", inputs={"spec": _full(), "num_computed_tokens": 100}),
        Case(name="chunked_local", inputs={"spec": chunked, "num_computed_tokens": 130}),
        Case(name="mamba", inputs={"spec": mamba, "num_computed_tokens": 10}),
    ]


def _prune_pins() -> list[Case]:
    config = _config([_full(), _sw(32)], num_blocks=16)
    return [
        Case(
            name="sliding_prunes_leading_blocks",
            inputs={"config": config, "block_ids": BlockIds([[1, 2, 3, 4], [5, 6, 7, 8]]), "num_computed_tokens": 64},
            description="skipped 33 tokens: 2 whole blocks become null",
        ),
        Case(
            name="stops_at_existing_null",
            inputs={"config": config, "block_ids": BlockIds([[1, 2, 3, 4], [0, 6, 7, 8]]), "num_computed_tokens": 80},
        ),
        Case(
            name="group_count_mismatch",
            inputs={"config": config, "block_ids": BlockIds([[1, 2]]), "num_computed_tokens": 16},
        ),
        Case(
            name="worked_example",
            inputs={"config": _worked_config(), "block_ids": _WORKED_TABLE, "num_computed_tokens": 100},
            description="docs/explanation/worked-example.md: the SW group's first 3 blocks become null",
        ),
    ]


def _gen_prune(rng: random.Random) -> dict[str, object]:
    config = _rand_config(rng)
    t = rng.randint(0, 100)
    return {"config": config, "block_ids": _table(config, t, rng), "num_computed_tokens": t + rng.randint(0, 20)}


def _worked_config() -> KVCacheConfig:
    """docs/explanation/worked-example.md: one SW group (W=48) listed first, then full attention, B=16."""
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="bf16", sliding_window=48)
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="bf16")
    return _config([sw, fa], num_blocks=64)


_WORKED_TABLE = BlockIds([[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]])


def _worked_exchange(num_tokens: int, pruned_with: int) -> dict[str, object]:
    config = _worked_config()
    table = BlockIds([g[: -(-num_tokens // 16)] for g in _WORKED_TABLE])
    producer = get_exchange_clipped_blocks(
        get_pruned_block_ids(config, table, num_computed_tokens=pruned_with), get_blocks_per_sw(config)
    )
    counts = get_consumer_block_counts(config, num_tokens=num_tokens, prefix_hit_tokens=0)
    consumer = BlockIds([[41 + i for i in range(counts[0])], [51 + i for i in range(counts[1])]])
    return {
        "config": config,
        "num_tokens": num_tokens,
        "prefix_hit_tokens": 0,
        "producer_block_ids": producer,
        "consumer_block_ids": consumer,
    }


def _worked_pins() -> list[Case]:
    worked = {
        "config": _worked_config(),
        "num_tokens": 100,
        "prefix_hit_tokens": 32,
        "producer_block_ids": BlockIds([[14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]]),
        "consumer_block_ids": BlockIds([[41, 42, 43, 44], [51, 52, 53, 54, 55]]),
    }
    return [
        Case(name="worked_example", inputs=worked, description="docs/explanation/worked-example.md: T=100, H=32"),
        Case(
            name="worked_example_t94_pruned_with_t",
            inputs=_worked_exchange(94, 94),
            description="(94 - 48 + 2) % 16 == 0, pruned with T: passes",
        ),
        Case(
            name="worked_example_t94_pruned_with_t_plus_1",
            inputs=_worked_exchange(94, 95),
            description="pruned with T + 1 (docs/spec/alignment-and-coverage.md): WindowCoverageError at block 2",
        ),
        Case(
            name="worked_example_t95_pruned_with_t_plus_1",
            inputs=_worked_exchange(95, 96),
            description="(95 - 48 + 1) % 16 == 0: the extra null is not needed",
        ),
    ]


def _null_either_side_pins() -> list[Case]:
    # W=32, B=16. T=47: (T-W+1) % B == 0, SW needs blocks 1..2, so block 0 may be null on either side.
    # T=46: (T-W+2) % B == 0, SW needs blocks 0..2: a null at block 0 on either side fails (WIN-1).
    config = _tokens_config()
    fa_p, fa_c = [1, 2, 3], [11, 12, 13]
    cases = []
    for t in (47, 46):
        for role, producer, consumer in (
            ("producer", [fa_p, [0, 5, 6]], [fa_c, [14, 15, 16]]),
            ("consumer", [fa_p, [4, 5, 6]], [fa_c, [0, 15, 16]]),
        ):
            inputs = {"config": config, "num_tokens": t, "prefix_hit_tokens": 0, **_pairs(producer, consumer)}
            cases.append(Case(name=f"t{t}_null_block0_on_{role}", inputs=inputs, description=f"W=32 B=16 T={t}"))
    return cases


def _tokens_config() -> KVCacheConfig:
    return _config([_full(), _sw(32)], num_blocks=64)


def _consumer_count_pins() -> list[Case]:
    config = _tokens_config()

    def case(name: str, t: int, h: int, description: str = "") -> Case:
        return Case(
            name=name, inputs={"config": config, "num_tokens": t, "prefix_hit_tokens": h}, description=description
        )

    return [
        case("t_minus_w_plus_1_on_boundary", 47, 0, "W=32 B=16 T=47"),
        case("t_minus_w_plus_2_on_boundary", 46, 0, "W=32 B=16 T=46"),
        case("prefix_hit_in_window", 64, 48),
        case("full_prefix_hit", 64, 64),
        case("prefix_not_whole_blocks", 64, 8, "H must be a multiple of every block size"),
        case("prefix_above_tokens", 16, 32),
        Case(
            name="worked_example",
            inputs={"config": _worked_config(), "num_tokens": 100, "prefix_hit_tokens": 32},
            description="docs/explanation/worked-example.md: (4, 5)",
        ),
    ]


def _window_boundaries() -> list[tuple[str, int]]:
    """The W=32, B=16, no-hit rows of the WIN-1 pins (both boundaries the rule names), as (name, T)."""
    found = []
    for pin in pins_for("WIN-1"):
        given: Mapping[str, Any] = pin.inputs
        if (given["window"], given["block_size"], given["prefix_hit_tokens"]) == (32, 16, 0):
            found.append((pin.name, int(given["num_tokens"])))
    return found


def _coverage_pins() -> list[Case]:
    config = _tokens_config()
    cases = [
        Case(name=name, inputs=_exchange(config, t, 0), description=f"sound exchange, W=32 B=16 T={t}")
        for name, t in _window_boundaries()
    ]
    short = _exchange(config, 64, 0)
    short["producer_block_ids"] = BlockIds([list(short["producer_block_ids"][0]), [0, 9, 10]])  # type: ignore[index]
    cases.append(Case(name="needed_block_null_on_producer", inputs=short, description="WindowCoverageError"))
    # Pruning with more tokens than C uses nulls a block C still needs (docs/spec/alignment-and-coverage.md).
    overpruned = _exchange(config, 47, 0)
    overpruned["producer_block_ids"] = get_exchange_clipped_blocks(
        get_pruned_block_ids(config, _table(config, 47), num_computed_tokens=48 + 16), get_blocks_per_sw(config)
    )
    cases.append(
        Case(
            name="pruned_with_too_many_tokens",
            inputs=overpruned,
            description="pruned with T + 17 (docs/spec/alignment-and-coverage.md)",
        )
    )
    hit = _exchange(config, 64, 64)
    cases.append(Case(name="full_prefix_hit_zero_groups", inputs=hit))
    cases.append(
        Case(
            name="zero_groups_but_blocks_needed",
            inputs={**_exchange(config, 64, 32), "consumer_block_ids": BlockIds([])},
        )
    )
    cases += _null_either_side_pins() + _worked_pins()
    too_long = _exchange(config, 32, 0)
    too_long["consumer_block_ids"] = BlockIds([[1, 2, 3], [4, 5]])
    cases.append(Case(name="consumer_lists_too_many", inputs=too_long))
    return cases


def _plan_pins() -> list[Case]:
    config = _config([_full(), _sw(32)], num_blocks=16, layers=2)
    other = _config([_full(), _sw(32)], num_blocks=16, layers=2, layout="layers_first")

    def case(
        name: str, consumer_config: KVCacheConfig, p: Sequence[Sequence[int]], c: Sequence[Sequence[int]], d: str = ""
    ) -> Case:
        return Case(
            name=name,
            inputs={"producer_config": config, "consumer_config": consumer_config, **_pairs(p, c)},
            description=d,
        )

    return [
        case("contiguous_runs_merge", config, [[1, 2, 3], [4, 5]], [[6, 7, 8], [9, 10]], "merged on both sides"),
        case("fragmented", config, [[3, 1, 7], [4, 12]], [[2, 9, 5], [11, 6]]),
        case("other_layout_on_consumer", other, [[1, 2], [3]], [[1, 2], [3]], "layers_first consumer"),
        case("zero_groups", config, [], [], "full prefix hit: empty plan"),
        case("block_outside_pool", config, [[1, 16], [3]], [[2, 3], [4]], "id 16 of 16 blocks"),
        case("duplicate_consumer_id", config, [[1, 2], [3]], [[5, 5], [6]], "two copies onto one page"),
        case("group_count_mismatch", config, [[1], [2]], [[1]], ""),
    ]


def _gen_plan(rng: random.Random) -> dict[str, object]:
    case = _rand_exchange(rng, mutate=False)
    config: KVCacheConfig = case["config"]  # type: ignore[assignment]
    fields = {name: value for name, value in case.items() if name != "config"}
    pairs = compute_transfer_pairs(config, TransferRequest(**fields))  # type: ignore[arg-type]
    other = _config(
        [g.kv_cache_spec for g in config.kv_cache_groups],
        num_blocks=config.num_blocks,
        layers=len(config.kv_cache_groups[0].layer_names),
        layout=rng.choice(["blocks_first", "layers_first"]),
    )
    return {
        "producer_config": config,
        "consumer_config": other,
        "producer_block_ids": pairs.producer_block_ids,
        "consumer_block_ids": pairs.consumer_block_ids,
    }


def _gen_summary(rng: random.Random) -> dict[str, object]:
    case = _rand_exchange(rng, mutate=False)
    return {
        "config": case["config"],
        "num_tokens": case["num_tokens"],
        "prefix_hit_tokens": case["prefix_hit_tokens"],
        "mode": rng.choice(["read", "write"]),
    }


# --------------------------------------------------------------------------- HS-1


def _descriptor(config: KVCacheConfig, **overrides: Any) -> EngineDescriptor:
    base = EngineDescriptor.from_config(engine_id="P", config=config, mode=TransferMode.READ, hma_enabled=True)
    return attrs.evolve(base, **overrides)


def _group(descriptor: EngineDescriptor, index: int, **overrides: Any) -> EngineDescriptor:
    groups = list(descriptor.groups)
    groups[index] = attrs.evolve(groups[index], **overrides)
    return attrs.evolve(descriptor, groups=tuple(groups))


def _hs_pins() -> list[Case]:
    producer = _descriptor(_config([_sw(32), _full()], num_blocks=32))
    consumer = attrs.evolve(producer, engine_id="C", num_blocks=64, transport_metadata=b"agent-c")

    def case(name: str, c: EngineDescriptor, description: str = "") -> Case:
        return Case(name=name, inputs={"producer": producer, "consumer": c}, description=description)

    return [
        case("compatible", consumer, "engine id, pool size and transport metadata may differ"),
        case(
            "block_size_differs",
            _group(consumer, 0, block_size=32, page_size_bytes=2048),
            "block-size ratios: out of v1",
        ),
        case("group_order_swapped", attrs.evolve(consumer, groups=consumer.groups[::-1])),
        case("other_major", attrs.evolve(consumer, protocol_version=(2, 0))),
        case("newer_minor", attrs.evolve(consumer, protocol_version=(1, 7)), "minors are compatible"),
        case("tp_size_differs", attrs.evolve(consumer, tp_size=2), "heterogeneous TP: out of v1"),
        case("mode_and_hma_differ", attrs.evolve(consumer, mode=TransferMode.WRITE, hma_enabled=False)),
        case("group_count_differs", attrs.evolve(consumer, groups=consumer.groups[:1])),
        case("window_and_dtype_differ", _group(consumer, 0, sliding_window=64, dtype="bfloat16")),
        *_hs_parallel_pins(),
    ]


def _ranked(tp: int, rank: int, *, heads: int = 4, order: str = "hnd") -> EngineDescriptor:
    """One rank of an engine with ``heads`` KV heads at TP ``tp``, with its 1.3 parallel layout (PAR-9)."""
    share = max(1, heads // tp)
    config = _config([_sw(32), _full()], num_blocks=32)
    base = _descriptor(config, engine_id=f"tp{tp}.{rank}", tp_size=tp)
    groups = tuple(attrs.evolve(g, num_kv_heads=share, page_size_bytes=g.page_size_bytes * share) for g in base.groups)
    layout = ParallelLayout(rank=RankLayout(tp_size=tp, tp_rank=rank), pages=[_kv_page(heads, order=order)] * 2)
    return attrs.evolve(base, groups=groups, parallel=layout)


def _hs_parallel_pins() -> list[Case]:
    # Protocol 1.3: both peers' layouts decide unequal TP (PAR-9); a layout on one side only keeps equal TP.
    def case(name: str, producer: EngineDescriptor, consumer: EngineDescriptor, description: str) -> Case:
        return Case(name=name, inputs={"producer": producer, "consumer": consumer}, description=description)

    return [
        case("parallel_tp1_to_tp4_admitted", _ranked(1, 0), _ranked(4, 2), "the byte maps compose (PAR-9)"),
        case("parallel_tp4_to_tp1_admitted", _ranked(4, 3), _ranked(1, 0), "rank 3 is one the consumer faces"),
        case(
            "parallel_heads_do_not_divide",
            _ranked(1, 0, heads=6),
            _ranked(4, 1, heads=6),
            "6 KV heads over TP4: refused naming the sub-block's extent (PAR-1)",
        ),
        case(
            "parallel_opaque_page",
            _ranked(1, 0, order="opaque"),
            _ranked(2, 1, order="opaque"),
            "an opaque page cannot be sliced (PAR-5)",
        ),
        case("parallel_tp_sizes_do_not_divide", _ranked(2, 0), _ranked(3, 0, heads=4), "neither divides (PAR-4)"),
        case(
            "parallel_one_side_only",
            attrs.evolve(_ranked(1, 0), parallel=None),
            _ranked(4, 0),
            "a 1.2 peer sends no layout: equal TP only, as before",
        ),
    ]


def _cache1_pins() -> list[Case]:
    """CACHE-1 at handshake: declared caches exchanged or ephemeral, equal on both sides, kinds known."""
    config = _config([_sw(32), _full()], num_blocks=32)
    target = tuple(
        CacheDeclaration(name=f"target.{g}", kind=group.kv_cache_spec.kind.value, layer_names=group.layer_names)
        for g, group in enumerate(config.kv_cache_groups)
    )
    mtp = CacheDeclaration(name="mtp", kind="full_attention", layer_names=("mtp.0",), draft=True)
    ring = CacheDeclaration(name="ring", kind="circular_buffer", layer_names=("ring.0",), ephemeral=True)
    indexer = CacheDeclaration(name="indexer", kind="indexer", layer_names=("indexer.0",), ephemeral=True)
    unknown = CacheDeclaration(name="c", kind="compressed_state", layer_names=("c.0",), draft=True, ephemeral=True)

    def declared(*extra: CacheDeclaration) -> EngineDescriptor:
        return _descriptor(config, caches=(*target, *extra))

    def case(name: str, producer: EngineDescriptor, consumer: EngineDescriptor, description: str) -> Case:
        consumer = attrs.evolve(consumer, engine_id="C")
        return Case(name=name, inputs={"producer": producer, "consumer": consumer}, description=description)

    ephemeral_mtp = attrs.evolve(mtp, ephemeral=True)
    return [
        case("accounted", declared(ephemeral_mtp, ring), declared(ephemeral_mtp, ring), "draft and scratch ephemeral"),
        case("draft_groups_omitted", declared(mtp), declared(mtp), "vLLM #54926: equal groups, the draft unaccounted"),
        case("unknown_kind", declared(unknown), declared(unknown), "refused by name, even declared ephemeral"),
        case("target_declared_ephemeral", declared(indexer), declared(indexer), "ROCm/ATOM #1368: an indexer"),
        case("sets_differ", declared(ephemeral_mtp), declared(ring), "each side accounted, the sets differ"),
        case("older_peer", declared(ephemeral_mtp), _descriptor(config), "a 1.2 peer: its groups are its set"),
    ]


_GROUP_MUTATIONS: tuple[tuple[str, Callable[[random.Random, GroupDescriptor], object]], ...] = (
    ("block_size", lambda rng, g: g.block_size * 2),
    ("num_kv_heads", lambda rng, g: (g.num_kv_heads or 1) + 1),
    ("head_size", lambda rng, g: (g.head_size or 1) * 2),
    ("dtype", lambda rng, g: "float32" if g.dtype != "float32" else "float16"),
    ("page_size_bytes", lambda rng, g: g.page_size_bytes + 16),
    ("layer_names", lambda rng, g: (*g.layer_names, "extra.layer")),
)


def _gen_hs(rng: random.Random) -> dict[str, object]:
    producer = _descriptor(_rand_config(rng, num_blocks=16))
    consumer = attrs.evolve(producer, engine_id="C")
    for _ in range(rng.randint(0, 2)):
        index = rng.randrange(len(consumer.groups))
        name, change = rng.choice(_GROUP_MUTATIONS)
        consumer = _group(consumer, index, **{name: change(rng, consumer.groups[index])})
    if rng.random() < 0.2:
        consumer = attrs.evolve(consumer, tp_size=rng.choice([2, 4]))
    return {"producer": producer, "consumer": consumer}


# --------------------------------------------------------------------------- VER-1


def _messages() -> list[tuple[str, object]]:
    params = _params()
    return [
        ("engine_descriptor", _descriptor(_config([_sw(32), _full()], num_blocks=32), transport_metadata=b"meta")),
        ("transfer_params", params),
        ("transfer_params_opaque_transport", _params(transport_data=b"\x01\x02", mode=TransferMode.WRITE)),
        ("block_offer", BlockOffer(request_id="req-1", consumer_engine_id="C", consumer_block_ids=[[7, 8], [9]])),
        ("completion", Completion(request_id="req-1", producer_engine_id="P")),
        (
            "failure",
            Failure(
                request_id="req-1",
                producer_engine_id="P",
                reason=FailureReason.LEASE_EXPIRED,
                failed_consumer_block_ids=[[7], [9]],
                detail="lease ran out",
            ),
        ),
        ("release", Release(request_id="req-1", consumer_engine_id="C", outcome=ReleaseOutcome.PREFIX_HIT)),
        ("abort", Abort(request_id="req-1", engine_id="C")),
    ]


def _encode_pins() -> list[Case]:
    return [Case(name=name, inputs={"message": message}) for name, message in _messages()]


def _text(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def _decode_pins() -> list[Case]:
    def case(name: str, data: bytes, description: str = "") -> Case:
        return Case(name=name, inputs={"bytes": data}, description=description)

    release = json.loads(encode(Release(request_id="r", consumer_engine_id="C", outcome=ReleaseOutcome.LOADED)))
    cases = [case(f"valid_{name}", encode(message)) for name, message in _messages()]  # type: ignore[arg-type]
    return [
        *cases,
        case("newer_minor_unknown_field", _text({**release, "v": [PROTOCOL_VERSION[0], 9], "extra": 1}), "ignored"),
        case("other_major", _text({**release, "v": [PROTOCOL_VERSION[0] + 1, 0]})),
        case("missing_field", _text({k: v for k, v in release.items() if k != "outcome"})),
        case("mistyped_field", _text({**release, "request_id": 7})),
        case("unknown_enum_value", _text({**release, "outcome": "exploded"})),
        case("empty_request_id", _text({**release, "request_id": ""})),
        case("unknown_type", _text({**release, "type": "teleport"})),
        case("missing_version", _text({k: v for k, v in release.items() if k != "v"})),
        case("not_json", b"{not json"),
        case("not_an_object", b"[1,2,3]"),
        case("not_utf8", b"\xff\xfe\x00"),
        case("empty", b""),
        case("negative_block_id", _text({**json.loads(encode(_messages()[3][1])), "consumer_block_ids": [[-1]]})),  # type: ignore[arg-type]
        case("bad_base64", _text({**json.loads(encode(_messages()[0][1])), "transport_metadata": "***"})),  # type: ignore[arg-type]
        case("nan_deadline", b'{"type":"transfer_params","v":[1,0],"lease_deadline":NaN}'),
    ]


def _gen_message(rng: random.Random) -> object:
    ids = BlockIds(_rand_ids(rng, rng.randint(1, 3), most=4))
    request = f"req-{rng.randint(0, 999)}"
    choice = rng.randrange(5)
    if choice == 0:
        return _params(
            request_id=request,
            producer_block_ids=ids,
            num_tokens=rng.randint(0, 9999),
            lease_deadline=rng.randint(0, 10**6) / 8,
            mode=rng.choice(list(TransferMode)),
        )
    if choice == 1:
        return BlockOffer(request_id=request, consumer_engine_id="C", consumer_block_ids=ids)
    if choice == 2:
        return Failure(
            request_id=request,
            producer_engine_id="P",
            reason=rng.choice(list(FailureReason)),
            failed_consumer_block_ids=ids,
        )
    if choice == 3:
        return Release(request_id=request, consumer_engine_id="C", outcome=rng.choice(list(ReleaseOutcome)))
    return _descriptor(_rand_config(rng, num_blocks=16), transport_metadata=rng.randbytes(rng.randint(0, 6)))


def _gen_encode(rng: random.Random) -> dict[str, object]:
    return {"message": _gen_message(rng)}


def _gen_decode(rng: random.Random) -> dict[str, object]:
    data = bytearray(encode(_gen_message(rng)))  # type: ignore[arg-type]
    if rng.random() < 0.6:
        for _ in range(rng.randint(1, 3)):  # a corrupted byte string: decode raises a kvspec error or decodes
            data[rng.randrange(len(data))] = rng.choice(b'{}[]",:0123456789aez\x00\xff')
    return {"bytes": bytes(data)}


# --------------------------------------------------------------------------- INT-1

_DIGEST_A = "0123456789abcdef" * 2
_DIGEST_B = "fedcba9876543210" * 2


def _int1_messages() -> list[tuple[str, object]]:
    return [
        (
            "transfer_params_with_digests",
            _params(
                producer_block_ids=[[0, 4, 5], [6]], producer_block_digests=[["", _DIGEST_A, _DIGEST_B], [_DIGEST_A]]
            ),
        ),
        (
            "completion_with_digests",
            Completion(
                request_id="req-1", producer_engine_id="P", consumer_block_digests=[[_DIGEST_A, ""], [_DIGEST_B]]
            ),
        ),
    ]


def _int1_encode_pins() -> list[Case]:
    return [Case(name=name, inputs={"message": message}) for name, message in _int1_messages()]


def _int1_decode_pins() -> list[Case]:
    def case(name: str, data: bytes, description: str = "") -> Case:
        return Case(name=name, inputs={"bytes": data}, description=description)

    params = json.loads(encode(_int1_messages()[0][1]))  # type: ignore[arg-type]
    completion = json.loads(encode(_int1_messages()[1][1]))  # type: ignore[arg-type]
    return [
        *(case(f"valid_{name}", encode(message)) for name, message in _int1_messages()),  # type: ignore[arg-type]
        case(
            "digest_for_null_block",
            _text({**params, "producer_block_digests": [[_DIGEST_A, _DIGEST_A, _DIGEST_B], [_DIGEST_A]]}),
            "a null id has the empty digest",
        ),
        case(
            "missing_digest_for_real_block",
            _text({**params, "producer_block_digests": [["", "", _DIGEST_B], [_DIGEST_A]]}),
        ),
        case("one_digest_short", _text({**params, "producer_block_digests": [["", _DIGEST_A], [_DIGEST_A]]})),
        case("uppercase_hex", _text({**completion, "consumer_block_digests": [[_DIGEST_A.upper(), ""], [_DIGEST_B]]})),
        case("short_digest", _text({**completion, "consumer_block_digests": [[_DIGEST_A[:-2], ""], [_DIGEST_B]]})),
        case("no_digests_is_null", _text({k: v for k, v in completion.items() if k != "consumer_block_digests"})),
    ]


def _int1_dict_pins() -> list[Case]:
    as_dict = _params(
        producer_block_ids=[[0, 4, 5], [6]], producer_block_digests=[["", _DIGEST_A, _DIGEST_B], [_DIGEST_A]]
    ).to_kv_transfer_params()
    return [
        Case(name="digests_round_trip", inputs={"kv_transfer_params": as_dict}),
        Case(
            name="digest_not_hex",
            inputs={"kv_transfer_params": {**as_dict, "kvspec_block_digests": [["", "xyz", _DIGEST_B], [_DIGEST_A]]}},
        ),
        Case(name="digests_not_a_list", inputs={"kv_transfer_params": {**as_dict, "kvspec_block_digests": _DIGEST_A}}),
    ]


# --------------------------------------------------------------------------- INT-2, INT-3


def _int2_data(page: CanonicalPage, tp_size: int, tp_rank: int, seed: str) -> bytes:
    """Rank ``tp_rank``'s page of a seeded canonical page: its bytes where PAR-2 puts them, zeros elsewhere."""
    canonical = random.Random(seed).randbytes(page.nbytes)
    runs = get_rank_page_map(page, tp_size=tp_size, tp_rank=tp_rank)
    out = bytearray(sum(r.nbytes for r in runs))
    for r in runs:
        out[r.rank_offset : r.rank_offset + r.nbytes] = canonical[r.canonical_offset : r.canonical_offset + r.nbytes]
    return bytes(out)


def _int2_inputs(
    policy: DigestPolicy, *, heads: int = 2, tp: int = 1, rank: int = 0, split: int = 1, **kw: Any
) -> dict[str, object]:
    page = kw.pop("page", None) or _kv_page(heads)
    return {
        "policy": policy,
        "page": page,
        "data": _int2_data(page, tp, rank, kw.pop("seed", "int2")),
        "layer": kw.pop("layer", "model.layers.0.self_attn"),
        "position": kw.pop("position", 32),
        "tp_size": tp,
        "tp_rank": rank,
        "split": split,
        "granule": kw.pop("granule", 4),
    }


def _int2_digest_pins() -> list[Case]:
    xxh3, blake = DigestPolicy(), DigestPolicy(algorithm="blake2b-128")
    partial = DigestPolicy(mode="partial", partial_bytes=6)
    return [
        Case(name="full_xxh3_tp1", inputs=_int2_inputs(xxh3)),
        Case(name="full_blake2b_tp1", inputs=_int2_inputs(blake)),
        Case(
            name="full_xxh3_tp2_rank1_split2",
            inputs=_int2_inputs(xxh3, tp=2, rank=1, split=2),
            description="rank 1 adds the cells of head 1; rank 0's and its sums add up to the TP1 sums",
        ),
        Case(name="full_xxh3_tp2_rank0_split2", inputs=_int2_inputs(xxh3, tp=2, rank=0, split=2)),
        Case(name="full_xxh3_tp1_split2", inputs=_int2_inputs(xxh3, split=2)),
        Case(
            name="gqa_replica_rank1_adds_nothing",
            inputs=_int2_inputs(xxh3, heads=1, tp=2, rank=1, split=2),
            description="one KV head on two ranks: the lowest rank adds it, so the sum counts it once",
        ),
        Case(name="full_xxh3_granule_2", inputs=_int2_inputs(xxh3, granule=2), description="two positions per page"),
        Case(name="full_xxh3_nhd", inputs=_int2_inputs(xxh3, page=_kv_page(2, order="nhd"))),
        Case(name="partial_6_bytes", inputs=_int2_inputs(partial), description="2 cells: 3 bytes each, 2 + 1"),
        Case(name="partial_6_bytes_position_40", inputs=_int2_inputs(partial, position=40)),
        Case(name="granule_not_dividing_rows", inputs=_int2_inputs(xxh3, granule=3)),
    ]


def _int2_sample_pins() -> list[Case]:
    sampled = DigestPolicy(mode="sampled", sample_ppm=250_000, seed=42)
    return [
        *(
            Case(name=f"sampled_quarter_req_{i}", inputs={"policy": sampled, "request_id": f"req-{i}"})
            for i in range(8)
        ),
        Case(name="sampled_none", inputs={"policy": DigestPolicy(mode="sampled", sample_ppm=0), "request_id": "r"}),
        Case(name="full_always", inputs={"policy": DigestPolicy(mode="full", sample_ppm=0), "request_id": "r"}),
    ]


def _int3_pins() -> list[Case]:
    config = _config([_full(4), _sw(8, 4)])
    base = {
        "config": config,
        "num_tokens": 16,
        "prefix_hit_tokens": 0,
        "producer_block_ids": BlockIds([[1, 2, 3, 4], [5, 6, 7]]),
        "consumer_block_ids": BlockIds([[11, 12, 13, 14], [15, 16, 17]]),
        "recomputed_tokens": 0,
        "state_tokens": None,
    }
    return [
        Case(name="correct_lists", inputs=base),
        Case(
            name="window_not_clipped",
            inputs={**base, "producer_block_ids": BlockIds([[1, 2, 3, 4], [5, 6, 7, 8]])},
            description="4 window blocks past the budget 3: CLIP-1",
        ),
        Case(
            name="needed_block_null",
            inputs={**base, "consumer_block_ids": BlockIds([[11, 12, 0, 14], [15, 16, 17]])},
            description="WIN-1",
        ),
        Case(
            name="consumer_longer_than_producer",
            inputs={**base, "producer_block_ids": BlockIds([[2, 3, 4], [5, 6, 7]]), "num_tokens": 12},
        ),
    ]


# --------------------------------------------------------------------------- sessions

_LEASE = 30.0


def _event(call: str, now: float, **extra: object) -> dict[str, object]:
    return {"call": call, "now": now, **extra}


def _msg(message: object) -> dict[str, object]:
    return {"message": message}


def _producer_case(name: str, mode: TransferMode, events: list[dict[str, object]], description: str = "") -> Case:
    return Case(
        name=name,
        inputs={
            "params": _params(mode=mode, lease_deadline=_LEASE),
            "options": {"release_grace": 10.0, "drain_timeout": 5.0},
            "events": events,
        },
        description=description,
    )


def _consumer_case(
    name: str,
    mode: TransferMode,
    events: list[dict[str, object]],
    description: str = "",
    *,
    ids: Sequence[Sequence[int]] = ((7, 8), (9,)),
) -> Case:
    return Case(
        name=name,
        inputs={
            "params": _params(mode=mode, lease_deadline=_LEASE),
            "consumer_engine_id": "C",
            "consumer_block_ids": BlockIds(ids),
            "options": {"start_margin": 1.0, "transfer_timeout": 20.0, "drain_timeout": 5.0},
            "events": events,
        },
        description=description,
    )


READ, WRITE = TransferMode.READ, TransferMode.WRITE
_RELEASE = Release(request_id="req-1", consumer_engine_id="C", outcome=ReleaseOutcome.LOADED)
_OFFER = BlockOffer(request_id="req-1", consumer_engine_id="C", consumer_block_ids=[[7, 8], [9]])
_C_ABORT = Abort(request_id="req-1", engine_id="C")
_P_ABORT = Abort(request_id="req-1", engine_id="P")
_COMPLETION = Completion(request_id="req-1", producer_engine_id="P")
_FAILURE = Failure(request_id="req-1", producer_engine_id="P", reason=FailureReason.TRANSFER_ERROR)


def _sm1_pins() -> list[Case]:
    return [
        _producer_case("read_released", READ, [_event("receive", 1.0, **_msg(_RELEASE))]),
        _producer_case(
            "read_duplicate_release",
            READ,
            [_event("receive", 1.0, **_msg(_RELEASE)), _event("receive", 2.0, **_msg(_RELEASE))],
            "terminal states are sticky",
        ),
        _producer_case(
            "read_lease_plus_grace", READ, [_event("tick", 39.9), _event("tick", 40.0)], "expires at lease + grace"
        ),
        _producer_case("read_offer_is_remote_error", READ, [_event("receive", 1.0, **_msg(_OFFER))]),
        _producer_case("read_transfer_report_is_local_error", READ, [_event("transfer_done", 1.0)]),
        _producer_case(
            "write_offer_write_release",
            WRITE,
            [
                _event("receive", 1.0, **_msg(_OFFER)),
                _event("transfer_done", 2.0),
                _event("receive", 3.0, **_msg(_RELEASE)),
            ],
        ),
        _producer_case(
            "write_abort_while_writing",
            WRITE,
            [
                _event("receive", 1.0, **_msg(_OFFER)),
                _event("abort", 2.0),
                _event("tick", 6.9),
                _event("transfer_done", 7.0),
            ],
            "blocks freed only once the write drained",
        ),
        _producer_case(
            "write_lease_expires_while_writing",
            WRITE,
            [_event("receive", 1.0, **_msg(_OFFER)), _event("tick", 30.0), _event("tick", 35.0)],
        ),
        _producer_case(
            "write_failed",
            WRITE,
            [
                _event("receive", 1.0, **_msg(_OFFER)),
                _event("transfer_failed", 2.0, reason="transfer_error", detail="link down"),
                _event("receive", 3.0, **_msg(_RELEASE)),
            ],
            "FAIL-1: a Failure with C's blocks",
        ),
        _producer_case(
            "write_second_different_offer",
            WRITE,
            [
                _event("receive", 1.0, **_msg(_OFFER)),
                _event("receive", 1.5, **_msg(attrs.evolve(_OFFER, consumer_block_ids=[[1], [2]]))),
            ],
        ),
        _producer_case(
            "wrong_request_id", READ, [_event("receive", 1.0, **_msg(attrs.evolve(_RELEASE, request_id="other")))]
        ),
        _producer_case("peer_abort_before_offer", WRITE, [_event("receive", 1.0, **_msg(_C_ABORT))]),
    ]


def _consumer_pins(rule: str) -> list[Case]:
    start = _event("start", 0.0)
    if rule == "SM-2":
        return [
            _consumer_case("read_loaded", READ, [start, _event("transfer_done", 1.0)]),
            _consumer_case("write_loaded", WRITE, [start, _event("receive", 1.0, **_msg(_COMPLETION))]),
            _consumer_case(
                "read_abort_drains",
                READ,
                [start, _event("abort", 1.0), _event("tick", 5.9), _event("transfer_done", 6.0)],
                "blocks reused only after the drain",
            ),
            _consumer_case("read_abort_drain_timeout", READ, [start, _event("abort", 1.0), _event("tick", 6.0)]),
            _consumer_case(
                "write_abort_waits_for_producer",
                WRITE,
                [start, _event("abort", 1.0), _event("receive", 2.0, **_msg(_P_ABORT))],
            ),
            _consumer_case("start_twice", READ, [start, _event("start", 1.0)]),
            _consumer_case("completion_in_read", READ, [start, _event("receive", 1.0, **_msg(_COMPLETION))]),
        ]
    if rule == "REL-1":
        return [
            _consumer_case(
                "prefix_hit_releases_at_once", READ, [start], "zero groups: one release, outcome prefix_hit", ids=()
            ),
            _consumer_case("null_only_is_prefix_hit", WRITE, [start], ids=((0,), (0,))),
            _consumer_case(
                "loaded_then_late_signals",
                READ,
                [start, _event("transfer_done", 1.0), _event("abort", 2.0), _event("tick", 100.0)],
                "exactly one release",
            ),
            _consumer_case(
                "failed_releases_once",
                WRITE,
                [start, _event("receive", 1.0, **_msg(_FAILURE)), _event("receive", 2.0, **_msg(_P_ABORT))],
            ),
            _consumer_case("aborted_before_start", READ, [_event("abort", 0.5)]),
        ]
    if rule == "FAIL-1":
        return [
            _consumer_case(
                "read_transfer_failed", READ, [start, _event("transfer_failed", 1.0, reason="partial_transfer")]
            ),
            _consumer_case(
                "read_transfer_timeout",
                READ,
                [start, _event("tick", 20.0), _event("transfer_failed", 21.0, reason="transfer_error")],
                "timeout cancels, then drains",
            ),
            _consumer_case("write_lease_runs_out", WRITE, [start, _event("tick", 30.0), _event("tick", 35.0)]),
            _consumer_case(
                "never_started_past_start_margin", READ, [_event("tick", 29.0)], "start_margin before the lease"
            ),
            _consumer_case(
                "failure_names_failed_blocks",
                WRITE,
                [start, _event("receive", 1.0, **_msg(attrs.evolve(_FAILURE, failed_consumer_block_ids=[[8], []])))],
            ),
            _consumer_case(
                "local_fail_while_loading",
                READ,
                [start, _event("fail", 1.0, reason="window_coverage", detail="block 3"), _event("transfer_done", 2.0)],
            ),
        ]
    # DONE-1: LOADED only once every paired byte is readable.
    return [
        _consumer_case(
            "write_transfer_done_is_local_error",
            WRITE,
            [start, _event("transfer_done", 1.0)],
            "C posts nothing in WRITE",
        ),
        _consumer_case("read_report_before_post", READ, [_event("transfer_done", 0.5)]),
        _consumer_case(
            "write_loaded_only_on_completion",
            WRITE,
            [start, _event("tick", 10.0), _event("receive", 11.0, **_msg(_COMPLETION))],
        ),
    ]


_P_CALLS = ("release", "offer", "peer_abort", "abort", "transfer_done", "transfer_failed", "tick")
_C_CALLS = ("start", "transfer_done", "transfer_failed", "completion", "failure", "peer_abort", "abort", "fail", "tick")


def _rand_now(rng: random.Random, now: float) -> float:
    return now + rng.choice([0.0, 0.5, 2.0, 5.0, 12.0])


def _gen_producer(rng: random.Random) -> dict[str, object]:
    mode = rng.choice([READ, WRITE])
    events, now = [], 0.0
    for _ in range(rng.randint(1, 6)):
        now = _rand_now(rng, now)
        call = rng.choice(_P_CALLS)
        if call in ("release", "offer", "peer_abort"):
            message = {"release": _RELEASE, "offer": _OFFER, "peer_abort": _C_ABORT}[call]
            events.append(_event("receive", now, **_msg(message)))
        elif call == "transfer_failed":
            events.append(_event(call, now, reason=rng.choice(list(FailureReason)).value))
        else:
            events.append(_event(call, now))
    return dict(_producer_case("g", mode, events).inputs)


def _gen_consumer(rng: random.Random) -> dict[str, object]:
    mode = rng.choice([READ, WRITE])
    events, now = [], 0.0
    for _ in range(rng.randint(1, 6)):
        now = _rand_now(rng, now)
        call = rng.choice(_C_CALLS)
        if call in ("completion", "failure", "peer_abort"):
            message = {"completion": _COMPLETION, "failure": _FAILURE, "peer_abort": _P_ABORT}[call]
            events.append(_event("receive", now, **_msg(message)))
        elif call in ("transfer_failed", "fail"):
            events.append(_event(call, now, reason=rng.choice(list(FailureReason)).value))
        else:
            events.append(_event(call, now))
    ids = () if rng.random() < 0.1 else ((7, 8), (9,))
    return dict(_consumer_case("g", mode, events, ids=ids).inputs)


# --------------------------------------------------------------------------- the case sets


# --------------------------------------------------------------------------- OFF-1 ... OFF-9 (docs/spec/offload.md)


def _offload(f: int, h: int = 4) -> OffloadConfig:
    return OffloadConfig(blocks_per_chunk=f, hash_block_size=h)


def _fa_sw(block: int = 4, window: int = 8) -> KVCacheConfig:
    """Full attention plus a window group, one block size (the vLLM HMA tests' B=4, W=8)."""
    return _config([_full(block), _sw(window, block)], num_blocks=64)


def _b12_b16() -> KVCacheConfig:
    """Two full-attention groups of block sizes 12 and 16 (page-size unification), so f=1."""
    return _config([_full(12), _full(16)], num_blocks=64)


def _mamba_config() -> KVCacheConfig:
    return _config([_full(16), MambaSpec(block_size=16, shapes=[[2, 2]], dtypes=["float32"])], num_blocks=8)


def _hashes(count: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode("ascii")).digest()[:8] for i in range(count)]


def _rand_offload_setup(rng: random.Random) -> tuple[KVCacheConfig, OffloadConfig]:
    """Full and window groups of one block size (any f), or of mixed sizes (f=1); h divides every size."""
    same = rng.random() < 0.7
    block = rng.choice([4, 8, 16])
    specs: list[KVCacheSpec] = []
    for _ in range(rng.randint(1, 3)):
        b = block if same else rng.choice([4, 8, 16])
        specs.append(_full(b) if rng.random() < 0.5 else _sw(rng.randint(1, 6 * b), b))
    sizes = {spec.block_size for spec in specs}
    f = rng.randint(1, 4) if len(sizes) == 1 else 1
    h = rng.choice([d for d in (1, 2, 4) if all(size % d == 0 for size in sizes)])
    return _config(specs, num_blocks=64), _offload(f, h)


def _local_hit(rng: random.Random, config: KVCacheConfig, num_tokens: int) -> int:
    step = max(g.kv_cache_spec.block_size for g in config.kv_cache_groups)  # sizes 4, 8, 16 divide the largest
    return rng.randint(0, num_tokens // step) * step


def _gen_chunk_sizes(rng: random.Random) -> dict[str, object]:
    config, offload = _rand_offload_setup(rng)
    f = offload.blocks_per_chunk if rng.random() < 0.7 else rng.randint(1, 4)
    h = rng.choice([None, offload.hash_block_size, 3])
    return {"config": config, "blocks_per_chunk": f, "hash_block_size": h}


def _off2_pins() -> list[Case]:
    def case(name: str, config: KVCacheConfig, count: int, offload: OffloadConfig, description: str = "") -> Case:
        return Case(
            name=name,
            inputs={"config": config, "block_hashes": _hashes(count), "offload": offload},
            description=description,
        )

    return [
        case("b12_b16_six_hashes", _b12_b16(), 6, _offload(1), "25 tokens: group 0 hashes 2, 5; group 1 hash 3"),
        case("b12_b16_shared_hash", _b12_b16(), 12, _offload(1), "48 tokens: both groups' last key is hash 11"),
        case("f3_b4", _fa_sw(), 10, _offload(3), "3 hashes per chunk: keys at hashes 2, 5, 8"),
        case("no_complete_chunk", _fa_sw(), 2, _offload(3)),
    ]


def _gen_keys(rng: random.Random) -> dict[str, object]:
    config, offload = _rand_offload_setup(rng)
    return {"config": config, "block_hashes": _hashes(rng.randint(0, 40)), "offload": offload}


def _store(
    config: KVCacheConfig, ids: Sequence[Sequence[int]], tokens: int, next_chunk: Sequence[int], f: int
) -> dict[str, object]:
    return {
        "config": config,
        "block_ids": BlockIds(ids),
        "num_offloadable_tokens": tokens,
        "next_chunk": list(next_chunk),
        "offload": _offload(f),
    }


_ISSUE_42945 = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 0, 105, 106, 107, 108, 109]]


def _off3_pins() -> list[Case]:
    config = _fa_sw()
    cases = [
        Case(
            name="hma_prompt_12",
            inputs=_store(config, [[1, 2, 3], [4, 5, 6]], 12, [0, 0], 1),
            description="B=4 W=8 f=1: chunks 0-2 of both groups",
        ),
        Case(
            name="hma_then_15_decoded",
            inputs=_store(config, [[1, 2, 3, 7, 8, 9, 10], [4, 5, 6, 11, 12, 13, 14]], 27, [3, 3], 1),
            description="O=27: chunks 3-5 of both groups",
        ),
        Case(
            name="issue_42945_count_without_nulls",
            inputs=_store(config, _ISSUE_42945, 40, [0, 0], 3),
            description="#42945: window chunks 1, 2; sources 105-108 from index 5; count 4, not 6",
        ),
        Case(
            name="null_after_real_id",
            inputs=_store(config, [[1, 2, 3], [4, 0, 6]], 12, [0, 0], 1),
            description="nulls only open a list: ConfigError",
        ),
        Case(
            name="too_few_ids",
            inputs=_store(config, [[1, 2], [4, 5, 6]], 12, [0, 0], 1),
        ),
        Case(
            name="mixed_block_sizes_f2",
            inputs=_store(_b12_b16(), [[1, 2], [3, 4]], 24, [0, 0], 2),
            description="f > 1 with B = (12, 16): ConfigError",
        ),
    ]
    # h=4, B=(12, 16), f=1 (vLLM HMA test): one request's steps at O = 25, 32, 36, 48, 96, each from the last.
    b12_b16, next_chunk = _b12_b16(), [0, 0]
    for tokens in (25, 32, 36, 48, 96):
        ids = [list(range(1, 9)), list(range(11, 17))]
        inputs = _store(b12_b16, ids, tokens, next_chunk, 1)
        cases.append(Case(name=f"b12_b16_step_o{tokens}", inputs=inputs, description="vLLM HMA test steps"))
        next_chunk = list(
            get_store_set(
                b12_b16, ids, num_offloadable_tokens=tokens, next_chunk=next_chunk, offload=_offload(1)
            ).next_chunks
        )
    return cases


def _off4_store_pins() -> list[Case]:
    return [
        Case(
            name="leading_nulls_leave_chunk_partial",
            inputs=_store(_fa_sw(), _ISSUE_42945, 40, [0, 0], 3),
            description="f=3: window chunk 1 is written from sub-block 2 only, so it is partial",
        ),
        Case(
            name="f1_never_partial",
            inputs=_store(_fa_sw(), [[1, 2, 3, 4], [0, 0, 7, 8]], 16, [0, 0], 1),
        ),
    ]


def _gen_store(rng: random.Random) -> dict[str, object]:
    config, offload = _rand_offload_setup(rng)
    f, tokens = offload.blocks_per_chunk, rng.randint(0, 80)
    ids, start, next_chunk = [], 1, []
    for group in config.kv_cache_groups:
        size = group.kv_cache_spec.block_size
        count = max(-(-tokens // size), tokens // (size * f) * f) + rng.choice([0, 0, 1])
        nulls = rng.randint(0, count) if isinstance(group.kv_cache_spec, SlidingWindowSpec) else 0
        ids.append([0] * nulls + list(range(start, start + count - nulls)))
        start += count
        next_chunk.append(rng.randint(0, tokens // (size * f) + 1))
    return {
        "config": config,
        "block_ids": BlockIds(ids),
        "num_offloadable_tokens": tokens,
        "next_chunk": next_chunk,
        "offload": offload,
    }


def _hit(config: KVCacheConfig, present: Sequence[Sequence[bool]], n: int, c: int, f: int = 1) -> dict[str, object]:
    return {"config": config, "present": present, "num_tokens": n, "local_hit_tokens": c, "offload": _offload(f)}


def _off5_pins() -> list[Case]:
    mamba = Case(name="mamba_refused", inputs=_hit(_mamba_config(), [[True], [True]], 20, 0), description="OFF-9 first")
    return [*_table_cases("OFF-5", "get_offload_hit_tokens"), mamba]


def _off4_hit_pins() -> list[Case]:
    config, t, x = _fa_sw(), True, False
    return [
        Case(
            name="partial_chunk_is_not_present",
            inputs=_hit(config, [[t, t], [x, x]], 25, 0, 3),
            description="f=3 B=4 W=8: R1 wrote window chunk 1 in part, so it is absent and the hit is 0",
        ),
        Case(
            name="partial_chunk_counted_present",
            inputs=_hit(config, [[t, t], [x, t]], 25, 0, 3),
            description="what a pool that reports the partial chunk answers: 24, reading an unwritten sub-block",
        ),
    ]


def _gen_hit(rng: random.Random) -> dict[str, object]:
    config, offload = _rand_offload_setup(rng)
    if rng.random() < 0.1:
        config = _rand_config(rng, _KINDS)
    n = rng.randint(0, 200)
    sizes = [g.kv_cache_spec.block_size * offload.blocks_per_chunk for g in config.kv_cache_groups]
    absent = rng.choice([0.0, 0.1, 0.3])
    present = [
        [rng.random() >= absent for _ in range(n // size - rng.choice([0, 0, 1]) * (n >= size))] for size in sizes
    ]
    return {
        "config": config,
        "present": present,
        "num_tokens": n,
        "local_hit_tokens": _local_hit(rng, config, n),
        "offload": offload,
    }


def _load(config: KVCacheConfig, ids: Sequence[Sequence[int]], t: int, c: int, f: int = 1) -> dict[str, object]:
    return {
        "config": config,
        "block_ids": BlockIds(ids),
        "num_tokens": t,
        "local_hit_tokens": c,
        "offload": _offload(f),
    }


def _fa_state() -> KVCacheConfig:
    return _config([_full(4), _pin_group({"block_size": 4, "window": None, "state": True})], num_blocks=16)


def _off6_pins() -> list[Case]:
    config, b12_b16 = _fa_sw(), _b12_b16()
    window = _config([_sw(4096, 32)], num_blocks=4096)
    issue_48959 = [[0] * 2934 + list(range(1, 130))]
    return [
        Case(name="hma_t12", inputs=_load(config, [[1, 2, 3], [4, 5, 6]], 12, 0), description="(0,0..2) (1,1..2)"),
        Case(name="hma_t16_c12", inputs=_load(config, [[1, 2, 3, 4], [0, 0, 7, 8]], 16, 12), description="(0,3) (1,3)"),
        Case(
            name="state_t12_c4",
            inputs=_load(_fa_state(), [[1, 2, 3, 4], [0, 0, 7, 8]], 12, 4),
            description="a state group restores one slot at T/B - 1 and says state_tokens = T = 12 (OFF-6, STATE-1)",
        ),
        Case(
            name="state_t_off_the_grid",
            inputs=_load(_fa_state(), [[1, 2, 3, 4], [0, 0, 7, 8]], 11, 0),
            description="no slot holds the state after 11 tokens: StatePositionError",
        ),
        Case(name="b12_b16_t48", inputs=_load(b12_b16, [[1, 2, 3, 4], [5, 6, 7]], 48, 0)),
        Case(
            name="b12_b16_t80_c48",
            inputs=_load(b12_b16, [list(range(1, 8)), list(range(11, 16))], 80, 48),
            description="chunk 6 (tokens 72-83) whole",
        ),
        Case(
            name="issue_48959_needs_129_blocks",
            inputs=_load(window, issue_48959, 98012, 0, 8),
            description="#48959: W=4096 B=32 f=8 T=98012: L=2934, G=3063, 129 blocks, not 128",
        ),
        Case(
            name="f3_first_index_4",
            inputs=_load(_config([_full(4)], num_blocks=16), [list(range(1, 10))], 36, 16, 3),
            description="f=3, L=4: chunks 1-2, the first read from sub-block 1",
        ),
        Case(
            name="null_destination",
            inputs=_load(config, [[1, 2, 3, 4], [0, 0, 0, 8]], 16, 0),
            description="window block 2 is needed: WindowCoverageError",
        ),
        Case(name="mamba_refused", inputs=_load(_mamba_config(), [[1, 2], [3]], 20, 0)),
    ]


def _gen_load(rng: random.Random) -> dict[str, object]:
    config, offload = _rand_offload_setup(rng)
    t = rng.randint(0, 80)
    c = _local_hit(rng, config, t)
    ids, start = [], 1
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        count = -(-t // spec.block_size)
        first = c if not isinstance(spec, SlidingWindowSpec) else max(c, t - spec.sliding_window + 1)
        nulls = min(first // spec.block_size, count)
        if rng.random() < 0.15:
            nulls = min(nulls + 1, count)  # one null too many: WindowCoverageError
        ids.append([0] * nulls + list(range(start, start + count - nulls)))
        start += count
    return {"config": config, "block_ids": BlockIds(ids), "num_tokens": t, "local_hit_tokens": c, "offload": offload}


def _gen_offset(rng: random.Random) -> dict[str, object]:
    f = rng.randint(1, 4)
    sub_block = rng.randint(0, f)  # f itself is one past the chunk: ConfigError
    return {
        "chunk_row": rng.randint(0, 10),
        "sub_block": sub_block,
        "page_size": rng.choice([256, 4096]),
        "blocks_per_chunk": f,
    }


def _gen_retained(rng: random.Random) -> dict[str, object]:
    config, offload = _rand_offload_setup(rng)
    return {"config": config, "num_computed_tokens": rng.randint(0, 200), "offload": offload}


def _none() -> list[Case]:
    return []


def _gen_config(kinds: Sequence[str]) -> Callable[[random.Random], Mapping[str, object]]:
    return lambda rng: {"config": _rand_config(rng, kinds, num_blocks=8)}


def _gen_spec(rng: random.Random) -> Mapping[str, object]:
    return {"spec": _rand_spec(rng, _KINDS)}


# --------------------------------------------------------------------------- STATE-1 .. STATE-5


def _state_config(mode: str = "none", block_size: int = 16, scratch: int = 0) -> KVCacheConfig:
    state = MambaSpec(
        block_size=block_size,
        shapes=[[2, 2], [1, 4]],
        dtypes=["float32", "float32"],
        mamba_type="gdn_attn",
        cache_mode=mode,
        num_speculative_blocks=scratch,
    )
    return _config([_full(), state], num_blocks=8)


def _position(
    state_tokens: int | None, num_tokens: int, recomputed: int, profile: str = "recompute"
) -> dict[str, object]:
    return {
        "config": _state_config(),
        "state_tokens": state_tokens,
        "num_tokens": num_tokens,
        "recomputed_tokens": recomputed,
        "profile": profile,
    }


def _state1_pins() -> list[Case]:
    no_state = _position(None, 9, 1) | {"config": _config([_full()], num_blocks=8)}
    return [
        Case(name="vllm_backoff", inputs=_position(9, 9, 1), description="vLLM: T = N - 1, state after T"),
        Case(name="past_the_resume_point", inputs=_position(10, 9, 1), description="would double-apply a token"),
        Case(name="short_of_the_resume_point", inputs=_position(8, 9, 1)),
        Case(name="missing_from_a_1_1_peer", inputs=_position(None, 9, 1)),
        Case(name="prebuilt", inputs=_position(10, 10, 0, "prebuilt"), description="SGLang: state after N"),
        Case(name="prebuilt_recomputing", inputs=_position(10, 10, 1, "prebuilt")),
        Case(name="no_state_groups", inputs=no_state),
    ]


def _state2_pins() -> list[Case]:
    config = _state_config("align", scratch=2)
    return [
        Case(
            name="drop_scratch_keep_last", inputs={"config": config, "block_ids": BlockIds([[1, 2], [0, 0, 5, 8, 9]])}
        ),
        Case(name="never_below_one", inputs={"config": config, "block_ids": BlockIds([[1], [7]])}),
        Case(name="null_state_slot", inputs={"config": config, "block_ids": BlockIds([[1], [4, 0, 8, 9]])}),
        Case(name="zero_groups_stay_zero", inputs={"config": config, "block_ids": BlockIds([])}),
    ]


def _state3_pins() -> list[Case]:
    def pair(p: list[int], c: list[int]) -> dict[str, object]:
        return {"producer_slots": p, "consumer_slots": c}

    return [
        Case(name="one_each", inputs=pair([5], [9])),
        Case(name="producer_longer_takes_its_tail", inputs=pair([0, 0, 5], [9])),
        Case(name="consumer_longer_by_one", inputs=pair([5], [0, 9])),
        Case(name="consumer_longer_by_two", inputs=pair([5], [0, 0, 9])),
        Case(name="producer_empty", inputs=pair([], [9])),
        Case(name="null_consumer_slot", inputs=pair([5], [9, 0])),
    ]


def _state4_pins() -> list[Case]:
    align, none = _state_config("align"), _state_config("none")
    return [
        Case(name="align_on_boundary", inputs={"config": align, "prefix_hit_tokens": 32}),
        Case(name="align_off_boundary", inputs={"config": _state_config("align", 32), "prefix_hit_tokens": 16}),
        Case(name="none_mode_no_hit", inputs={"config": none, "prefix_hit_tokens": 0}),
        Case(name="none_mode_hit", inputs={"config": none, "prefix_hit_tokens": 16}),
    ]


def _state4_hit_pins() -> list[Case]:
    config = _config([_full(4), _state_config("align", 8).kv_cache_groups[1].kv_cache_spec], num_blocks=8)
    return [
        Case(name="minimum", inputs={"config": config, "group_hits": [24, 16]}),
        Case(name="minimum_on_every_boundary", inputs={"config": config, "group_hits": [12, 16]}),
    ]


def _state5_pins() -> list[Case]:
    spec = _state_config().kv_cache_groups[1].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    return [
        Case(name="same", inputs={"producer": spec, "consumer": attrs.evolve(spec, cache_mode="align")}),
        Case(name="conv_layout", inputs={"producer": spec, "consumer": attrs.evolve(spec, conv_layout="SD")}),
        Case(
            name="kind_and_dtypes",
            inputs={"producer": spec, "consumer": attrs.evolve(spec, mamba_type="kda", dtypes=["float32", "bfloat16"])},
        ),
    ]


# --------------------------------------------------------------------------- PAR-1 .. PAR-8


def _par_page(*, b_groups: int = 1, order: str = "hnd") -> CanonicalPage:
    """The #55208 configuration: conv x 16 heads of 64 channels, B and C of 128, 3 taps, fp16; 16 SSM heads."""
    conv = [
        SubBlock(name="x", extent=16, width=64),
        SubBlock(name="B", extent=b_groups, width=128),
        SubBlock(name="C", extent=b_groups, width=128),
    ]
    return CanonicalPage(
        tensors=[
            PageTensor(name="conv", sub_blocks=conv, rows=1, element_bytes=3 * 2, order=order),
            PageTensor(name="ssm", sub_blocks=[SubBlock(name="heads", extent=16)], rows=1, element_bytes=64 * 128 * 2),
        ]
    )


def _kv_page(heads: int, *, order: str = "hnd") -> CanonicalPage:
    kv = [SubBlock(name="kv_heads", extent=heads)]
    return CanonicalPage(
        tensors=[PageTensor(name=n, sub_blocks=kv, rows=4, element_bytes=8, order=order, token_rows=True) for n in "kv"]
    )


def _sub(extent: int, **kw: Any) -> SubBlock:
    return SubBlock(name="kv_heads", extent=extent, **kw)


def _par1_pins() -> list[Case]:
    def owned(extent: int, tp: int, rank: int, **kw: Any) -> dict[str, object]:
        return {"sub_block": _sub(extent, **kw), "tp_size": tp, "tp_rank": rank}

    return [
        Case(name="split_8_heads_tp4_rank3", inputs=owned(8, 4, 3)),
        Case(name="gqa_replica_2_heads_tp8_rank5", inputs=owned(2, 8, 5), description="T > E: rank r holds r*E/T"),
        Case(name="replicated_latent", inputs=owned(1, 4, 2, replicated=True)),
        Case(name="refused_5_heads_tp2", inputs=owned(5, 2, 0), description="neither divides: refused by name"),
    ]


def _par2_pins() -> list[Case]:
    return [
        Case(name="issue_55208_tp2_rank1", inputs={"page": _par_page(), "tp_size": 2, "tp_rank": 1}),
        Case(name="nhd_heads_tp2_rank1", inputs={"page": _kv_page(2, order="nhd"), "tp_size": 2, "tp_rank": 1}),
    ]


def _par3_pins() -> list[Case]:
    # vLLM 0.33's remote_conv_offsets scales every sub-block by the TP ratio: rank 1 reads P's C as its B (#55208).
    naive = [
        RankCopy(producer_rank=0, consumer_rank=1, producer_offset=3072, consumer_offset=0, nbytes=3072),
        RankCopy(producer_rank=0, consumer_rank=1, producer_offset=6912, consumer_offset=3072, nbytes=768),
        RankCopy(producer_rank=0, consumer_rank=1, producer_offset=8448, consumer_offset=3840, nbytes=768),
        RankCopy(producer_rank=0, consumer_rank=1, producer_offset=138752, consumer_offset=4608, nbytes=131072),
    ]
    inputs = {"page": _par_page(), "producer_tp": 1, "consumer_tp": 2, "consumer_rank": 1}
    return [
        Case(name="issue_55208_ratio_scaled_refused", inputs={**inputs, "copies": naive}),
        Case(name="issue_55208_plan", inputs=inputs),
    ]


def _par3_check_pins() -> list[Case]:
    return _par3_pins()[:1]


def _par3_plan_pins() -> list[Case]:
    return [
        _par3_pins()[1],
        Case(
            name="tp8_to_tp2_two_heads",
            inputs={"page": _kv_page(2), "producer_tp": 8, "consumer_tp": 2, "consumer_rank": 1},
        ),
    ]


def _par4_pins() -> list[Case]:
    def elect(extent: int, unit: int, p: int, d: int, c: int) -> dict[str, object]:
        return {"sub_block": _sub(extent), "unit": unit, "producer_tp": p, "consumer_tp": d, "consumer_rank": c}

    return [
        Case(name="tp8_to_tp2_head_1_from_rank_4", inputs=elect(2, 1, 8, 2, 1), description="first replica faced"),
        Case(name="tp1_to_tp4_head_0", inputs=elect(2, 0, 1, 4, 1)),
        Case(name="tp3_refused", inputs=elect(2, 0, 2, 3, 0), description="one TP size must divide the other"),
    ]


def _par5_pins() -> list[Case]:
    return [
        Case(
            name="opaque_split_refused",
            inputs={"page": _kv_page(4, order="opaque"), "producer_tp": 1, "consumer_tp": 2},
        ),
        Case(
            name="opaque_equal_tp_whole",
            inputs={"page": _kv_page(4, order="opaque"), "producer_tp": 2, "consumer_tp": 2},
        ),
    ]


def _par6_pins() -> list[Case]:
    return [
        Case(name="tp1_to_tp4", inputs={"producer_tp": 1, "consumer_tp": 4, "producer_rank": 0}),
        Case(name="tp4_to_tp1_unread_rank_notified", inputs={"producer_tp": 4, "consumer_tp": 1, "producer_rank": 3}),
    ]


def _par9_pins() -> list[Case]:
    def layout(tp: int, rank: int, page: CanonicalPage, **kw: Any) -> ParallelLayout:
        return ParallelLayout(rank=RankLayout(tp_size=tp, tp_rank=rank, **kw), pages=[page])

    def case(name: str, producer: ParallelLayout, consumer: ParallelLayout, description: str = "") -> Case:
        return Case(name=name, inputs={"producer": producer, "consumer": consumer}, description=description)

    return [
        case("tp1_to_tp4_compose", layout(1, 0, _kv_page(4)), layout(4, 3, _kv_page(4))),
        case("mamba2_n_groups_1_tp1_to_tp2", layout(1, 0, _par_page()), layout(2, 1, _par_page()), "#55208's pair"),
        case("extents_differ", layout(1, 0, _kv_page(4)), layout(4, 0, _kv_page(8)), "first field that differs"),
        case("heads_do_not_divide", layout(1, 0, _kv_page(6)), layout(4, 0, _kv_page(6)), "PAR-1"),
        case("opaque_sliced", layout(1, 0, _kv_page(4, order="opaque")), layout(2, 1, _kv_page(4, order="opaque"))),
        case("rank_not_faced", layout(4, 3, _kv_page(4)), layout(2, 0, _kv_page(4)), "PAR-4"),
        case(
            "no_layer_in_common",
            layout(1, 0, _kv_page(4), layers=["layers.0"]),
            layout(4, 0, _kv_page(4), layers=["layers.1"]),
            "PAR-7",
        ),
        case("dcp_producer", layout(1, 0, _kv_page(4), dcp_size=2), layout(1, 0, _kv_page(4)), "PAR-8"),
    ]


def _par7_pins() -> list[Case]:
    layers = ["layers.0", "layers.1", "layers.2", "layers.3"]
    return [
        Case(name="pp2_to_pp1", inputs={"producer_stages": [layers[:2], layers[2:]], "consumer_stages": [layers]}),
        Case(name="missing_layer_refused", inputs={"producer_stages": [layers[:3]], "consumer_stages": [layers]}),
    ]


def _par8_pins() -> list[Case]:
    return [
        Case(
            name="dcp4_interleave2_rank1_token5",
            inputs={"local_index": 5, "dcp_size": 4, "dcp_rank": 1, "interleave": 2},
        ),
        Case(
            name="dcp2_interleave1_rank1_token0",
            inputs={"local_index": 0, "dcp_size": 2, "dcp_rank": 1, "interleave": 1},
        ),
    ]


def _par8_copies_pins() -> list[Case]:
    def dcp(p: int, d: int, size: int, rank: int, interleave: int) -> dict[str, object]:
        return {
            "page": _kv_page(2),
            "producer_tp": p,
            "consumer_tp": d,
            "consumer_rank": 0,
            "dcp_size": size,
            "dcp_rank": rank,
            "interleave": interleave,
        }

    return [
        Case(name="tp1_to_dcp2_rank1_interleave1", inputs=dcp(1, 1, 2, 1, 1), description="odd tokens of 2 pages"),
        Case(name="tp2_to_tp1_dcp2_rank0_interleave2", inputs=dcp(2, 1, 2, 0, 2)),
    ]


CASE_SETS: tuple[CaseSet, ...] = (
    CaseSet(
        rule="HMA-1",
        fn=is_hma_required,
        pinned=_hma_pins,
        generate=lambda rng: {"config": _rand_config(rng, _KINDS, num_blocks=8), _FLAG: rng.random() < 0.2},
    ),
    CaseSet(rule="HMA-1", fn=is_full_attention_spec, pinned=_full_attention_pins, generate=_gen_spec),
    CaseSet(
        rule="ADM-1", fn=check_hybrid_support, pinned=_pinned("ADM-1", "check_hybrid_support"), generate=_gen_admission
    ),
    CaseSet(
        rule="ADM-2", fn=check_hybrid_support, pinned=_pinned("ADM-2", "check_hybrid_support"), generate=_gen_admission
    ),
    CaseSet(rule="STATE-1", fn=check_state_position, pinned=_state1_pins),
    CaseSet(rule="STATE-2", fn=get_state_clipped_blocks, pinned=_state2_pins),
    CaseSet(rule="STATE-3", fn=pair_state_slots, pinned=_state3_pins),
    CaseSet(rule="STATE-4", fn=check_state_prefix_hit, pinned=_state4_pins),
    CaseSet(rule="STATE-4", fn=get_state_prefix_hit, pinned=_state4_hit_pins),
    CaseSet(rule="STATE-5", fn=get_state_differences, pinned=_state5_pins),
    CaseSet(rule="SW-1", fn=get_blocks_per_sw, pinned=_sw1_pins, generate=_gen_config(("full", "sw", "sw_mla", "mla"))),
    CaseSet(
        rule="CLIP-1",
        fn=get_exchange_clipped_blocks,
        pinned=_pinned("CLIP-1", "get_exchange_clipped_blocks"),
        generate=_gen_clip,
    ),
    CaseSet(rule="CLIP-1", fn=summarize_plan, pinned=_none, generate=_gen_summary),
    CaseSet(
        rule="ALIGN-1", fn=compute_block_pairs, pinned=_pinned("ALIGN-1", "compute_block_pairs"), generate=_gen_align
    ),
    CaseSet(rule="NULL-1", fn=compute_block_pairs, pinned=_pinned("NULL-1", "compute_block_pairs")),
    CaseSet(rule="NULL-1", fn=plan_transfer, pinned=_plan_null_pins),
    CaseSet(
        rule="WIN-1",
        fn=get_logical_block_count,
        pinned=_count_pins,
        generate=lambda rng: {"spec": _rand_spec(rng), "num_tokens": rng.randint(0, 100)},
    ),
    CaseSet(
        rule="WIN-1", fn=get_needed_token_range, pinned=_pinned("WIN-1", "get_needed_token_range"), generate=_gen_range
    ),
    CaseSet(
        rule="WIN-1", fn=get_needed_block_range, pinned=_pinned("WIN-1", "get_needed_block_range"), generate=_gen_range
    ),
    CaseSet(
        rule="WIN-1",
        fn=get_num_skipped_tokens,
        pinned=_skipped_pins,
        generate=lambda rng: {"spec": _rand_spec(rng, _KINDS), "num_computed_tokens": rng.randint(0, 200)},
    ),
    CaseSet(rule="WIN-1", fn=get_pruned_block_ids, pinned=_prune_pins, generate=_gen_prune),
    CaseSet(
        rule="WIN-1",
        fn=get_consumer_block_counts,
        pinned=_consumer_count_pins,
        generate=lambda rng: {
            k: v
            for k, v in _rand_exchange(rng, mutate=False).items()
            if k in ("config", "num_tokens", "prefix_hit_tokens")
        },
    ),
    CaseSet(rule="WIN-1", fn=check_window_coverage, pinned=_coverage_pins, generate=_rand_exchange),
    CaseSet(rule="WIN-1", fn=compute_transfer_pairs, pinned=_coverage_pins, generate=_rand_exchange),
    CaseSet(rule="TOK-1", fn=get_token_basis_group, pinned=_token_basis_pins, generate=_gen_config(_KINDS)),
    CaseSet(rule="TOK-1", fn=TransferParams.from_kv_transfer_params, pinned=_tok_dict_pins),
    CaseSet(rule="TOK-1", fn=TransferParams.to_kv_transfer_params, pinned=_tok_to_dict_pins),
    CaseSet(rule="HS-1", fn=check_compatibility, pinned=_hs_pins, generate=_gen_hs),
    CaseSet(rule="CACHE-1", fn=check_compatibility, pinned=_cache1_pins),
    CaseSet(rule="VER-1", fn=encode, pinned=_encode_pins, generate=_gen_encode),
    CaseSet(rule="VER-1", fn=decode, pinned=_decode_pins, generate=_gen_decode),
    CaseSet(rule="INT-1", fn=encode, pinned=_int1_encode_pins),
    CaseSet(rule="INT-1", fn=decode, pinned=_int1_decode_pins),
    CaseSet(rule="INT-1", fn=TransferParams.from_kv_transfer_params, pinned=_int1_dict_pins),
    CaseSet(rule="PLAN-1", fn=plan_transfer, pinned=_plan_pins, generate=_gen_plan),
    CaseSet(
        rule="PLAN-1",
        fn=blocks_needed_for,
        pinned=_none,
        generate=lambda rng: {"config": _rand_config(rng), "num_tokens": rng.randint(0, 500)},
    ),
    CaseSet(rule="SM-1", fn=ProducerSession, pinned=_sm1_pins, generate=_gen_producer),
    CaseSet(rule="SM-2", fn=ConsumerSession, pinned=lambda: _consumer_pins("SM-2"), generate=_gen_consumer),
    CaseSet(rule="REL-1", fn=ConsumerSession, pinned=lambda: _consumer_pins("REL-1")),
    CaseSet(rule="FAIL-1", fn=ConsumerSession, pinned=lambda: _consumer_pins("FAIL-1")),
    CaseSet(rule="DONE-1", fn=ConsumerSession, pinned=lambda: _consumer_pins("DONE-1")),
    CaseSet(rule="OFF-1", fn=get_chunk_sizes, pinned=_pinned("OFF-1", "get_chunk_sizes"), generate=_gen_chunk_sizes),
    CaseSet(rule="OFF-2", fn=get_offload_keys, pinned=_off2_pins, generate=_gen_keys),
    CaseSet(rule="OFF-3", fn=get_store_set, pinned=_off3_pins, generate=_gen_store),
    CaseSet(rule="OFF-4", fn=get_store_set, pinned=_off4_store_pins),
    CaseSet(rule="OFF-4", fn=get_offload_hit_tokens, pinned=_off4_hit_pins),
    CaseSet(rule="OFF-5", fn=get_offload_hit_tokens, pinned=_off5_pins, generate=_gen_hit),
    CaseSet(rule="OFF-6", fn=get_load_set, pinned=_off6_pins, generate=_gen_load),
    CaseSet(
        rule="OFF-7",
        fn=map_sub_blocks,
        pinned=_pinned("OFF-7", "map_sub_blocks"),
        generate=lambda rng: {
            "first_block_index": rng.randint(0, 20),
            "num_blocks": rng.randint(0, 10),
            "blocks_per_chunk": rng.randint(1, 4),
        },
    ),
    CaseSet(
        rule="OFF-7",
        fn=get_sub_block_offset,
        pinned=_pinned("OFF-7", "get_sub_block_offset"),
        generate=_gen_offset,
    ),
    CaseSet(
        rule="OFF-8",
        fn=get_retained_chunk_starts,
        pinned=_pinned("OFF-8", "get_retained_chunk_starts"),
        generate=_gen_retained,
    ),
    CaseSet(
        rule="OFF-9",
        fn=check_offload_support,
        pinned=_pinned("OFF-9", "check_offload_support"),
        generate=_gen_config(_KINDS),
    ),
    CaseSet(rule="INT-2", fn=digest_rank_page, pinned=_int2_digest_pins),
    CaseSet(rule="INT-2", fn=is_request_sampled, pinned=_int2_sample_pins),
    CaseSet(rule="INT-3", fn=check_request_blocks, pinned=_int3_pins),
    CaseSet(rule="PAR-1", fn=get_owned_units, pinned=_par1_pins),
    CaseSet(rule="PAR-2", fn=get_rank_page_map, pinned=_par2_pins),
    CaseSet(rule="PAR-3", fn=check_coverage, pinned=_par3_check_pins),
    CaseSet(rule="PAR-3", fn=compute_rank_copies, pinned=_par3_plan_pins),
    CaseSet(rule="PAR-4", fn=elect_source_rank, pinned=_par4_pins),
    CaseSet(rule="PAR-5", fn=check_page_sliceable, pinned=_par5_pins),
    CaseSet(rule="PAR-6", fn=get_completion_count, pinned=_par6_pins),
    CaseSet(rule="PAR-7", fn=pair_stage_layers, pinned=_par7_pins),
    CaseSet(rule="PAR-9", fn=get_layout_mismatch, pinned=_par9_pins),
    CaseSet(rule="PAR-8", fn=get_dcp_token_position, pinned=_par8_pins),
    CaseSet(rule="PAR-8", fn=compute_dcp_copies, pinned=_par8_copies_pins),
)
"""Which vectors each rule gets for each function; a new function adds one entry here."""


# --------------------------------------------------------------------------- building and writing


def _vector(case_set: CaseSet, name: str, inputs: Mapping[str, object], description: str) -> dict[str, Json]:
    encoded = {key: to_json(value) for key, value in inputs.items()}
    vector: dict[str, Json] = {"rule": case_set.rule, "function": case_set.function, "case": name}
    if description:
        vector["description"] = description
    vector["input"] = encoded
    vector.update(answer_vector(vector))  # the reference computes the expected answer
    if "error" in vector:
        del vector["error"]["message"]  # informative only; a reworded message must not change the vector
    if "unsupported" in vector:
        raise ConfigError(f"vectors: no registry entry for {case_set.function!r}")
    return vector


def _iter_cases(case_set: CaseSet, *, seed: int, count: int) -> Iterator[tuple[str, Mapping[str, object], str]]:
    for case in case_set.pinned():
        yield case.name, case.inputs, case.description
    if case_set.generate is not None:
        rng = random.Random(f"{seed}/{case_set.rule}/{case_set.function}")
        for i in range(count):
            yield f"generated_{i:03d}", case_set.generate(rng), ""


def build_vectors(
    *, seed: int = DEFAULT_SEED, count: int = DEFAULT_COUNT, rule: str | None = None
) -> list[dict[str, Json]]:
    """Every vector, pinned and generated, in case-set order (the whole spec, or one rule)."""
    known = {r.id for r in RULES}
    if rule is not None and rule not in known:
        raise ConfigError(f"vectors: rule: expected one of {sorted(known)}, got {rule!r}")
    vectors = []
    for case_set in CASE_SETS:
        if rule is not None and case_set.rule != rule:
            continue
        if case_set.function not in FUNCTIONS:  # pragma: no cover - guards the tables
            raise ConfigError(f"vectors: case set for unknown function {case_set.function!r}")
        vectors += [_vector(case_set, *case) for case in _iter_cases(case_set, seed=seed, count=count)]
    return vectors


def _dump(value: Json, indent: int) -> str:
    pad = "  " * indent
    if isinstance(value, dict) and value:
        items = [f"{pad}  {json.dumps(k)}: {_dump(v, indent + 1)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) and v for v in value):
        if all(isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v) for v in value):
            return json.dumps(value, separators=(", ", ": "))  # block ids stay on one line
        return "[\n" + ",\n".join(f"{pad}  {_dump(v, indent + 1)}" for v in value) + f"\n{pad}]"
    return json.dumps(value, sort_keys=True, ensure_ascii=True, allow_nan=False, separators=(", ", ": "))


def dumps_json(value: Json) -> str:
    """Stable, readable JSON text: sorted keys, two-space indent, flat lists on one line, ASCII, final newline."""
    return _dump(value, 0) + "\n"


def _clear(directory: Path) -> None:
    if not directory.exists():
        return
    entries = list(directory.iterdir())
    if entries and not (directory / MANIFEST).exists():
        raise ConfigError(f"vectors write: {directory} is not empty and holds no {MANIFEST}; refusing to write there")
    for entry in entries:
        # Only what a previous write left: rule folders, the manifest and the schemas.
        if entry.is_dir() and entry.name in {r.id for r in RULES}:
            shutil.rmtree(entry)
        elif entry.suffix == ".json":
            entry.unlink()


def write_vectors(
    directory: str | Path, *, seed: int = DEFAULT_SEED, count: int = DEFAULT_COUNT, rule: str | None = None
) -> list[Path]:
    """Write ``DIR/<rule>/<function>/<case>.json`` per vector, the schemas and a manifest; return the vector paths.

    A directory a previous write filled is replaced; any other non-empty directory is refused.
    """
    from kvspec import __version__

    folder = Path(directory)
    vectors = build_vectors(seed=seed, count=count, rule=rule)
    _clear(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written, counts = [], {}  # type: ignore[var-annotated]
    for vector in vectors:
        path = folder / vector["rule"] / vector["function"] / f"{vector['case']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps_json(vector), encoding="utf-8")
        written.append(path)
        per_rule = counts.setdefault(vector["rule"], {})
        per_rule[vector["function"]] = per_rule.get(vector["function"], 0) + 1
    manifest = {
        "format": FORMAT_VERSION,
        "kvspec_version": __version__,
        "protocol_version": list(PROTOCOL_VERSION),
        "seed": seed,
        "count": count,
        "rule": rule,
        "vectors": counts,
    }
    (folder / MANIFEST).write_text(dumps_json(manifest), encoding="utf-8")
    (folder / "vector.schema.json").write_text(dumps_json(vector_schema()), encoding="utf-8")
    (folder / "answer.schema.json").write_text(dumps_json(answer_schema()), encoding="utf-8")
    return written


def build_archive(*, seed: int = DEFAULT_SEED, count: int = DEFAULT_COUNT) -> bytes:
    """The whole vector set as a reproducible ``.tar.gz`` (fixed times and owners), rooted at ``kvspec-vectors/``."""
    import gzip
    import io
    import tarfile
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "kvspec-vectors"
        write_vectors(root, seed=seed, count=count)
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
            for path in sorted(root.rglob("*")):
                if path.is_file():
                    data = path.read_bytes()
                    info = tarfile.TarInfo(path.relative_to(root.parent).as_posix())
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()
