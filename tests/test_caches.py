"""CACHE-1: every cache a model keeps is exchanged or declared ephemeral, and peers declare the same set."""

from __future__ import annotations

import json

import attrs
import pytest
from kvspec_conformance.configs import chunked, full, indexer, make_config, mla, sw

from kvspec import (
    CacheAccountingError,
    CacheDeclaration,
    ConfigError,
    EngineDescriptor,
    IncompatiblePeerError,
    KVCacheConfig,
    MalformedMessageError,
    TransferMode,
    check_compatibility,
    decode,
    encode,
)
from kvspec.rules import get_rule
from kvspec.spec import (
    CACHE_KINDS,
    check_cache_accounting,
    get_cache_differences,
    get_cache_disposition,
    get_cache_problems,
    get_declared_caches,
    get_group_keys,
    may_be_ephemeral,
)

CONFIG = make_config(full(4), sw(8, 4), num_blocks=8)
GROUPS = get_group_keys(CONFIG)
TARGET = tuple(CacheDeclaration(name=f"t{g}", kind=kind, layer_names=layers) for g, (kind, layers) in enumerate(GROUPS))
MTP = CacheDeclaration(name="mtp", kind="full_attention", layer_names=("mtp.0",), draft=True)


def _declaring(*extra: CacheDeclaration, config: KVCacheConfig = CONFIG) -> KVCacheConfig:
    return attrs.evolve(config, caches=(*TARGET, *extra))


def _descriptor(config: KVCacheConfig, engine_id: str = "P") -> EngineDescriptor:
    return EngineDescriptor.from_config(engine_id=engine_id, config=config, mode=TransferMode.READ, hma_enabled=True)


def test_the_rule_is_registered() -> None:
    assert get_rule("CACHE-1").title == "Every cache accounted for"


def test_no_declaration_means_the_groups_each_exchanged() -> None:
    declared = get_declared_caches(CONFIG)
    assert [(c.kind, c.layer_names) for c in declared] == list(GROUPS)
    assert all(get_cache_disposition(c, GROUPS) == "exchanged" for c in declared)
    check_cache_accounting(CONFIG)


@pytest.mark.parametrize(
    ("cache", "disposition"),
    [
        (TARGET[0], "exchanged"),
        (attrs.evolve(MTP, ephemeral=True), "ephemeral"),
        (CacheDeclaration(name="r", kind="circular_buffer", layer_names=("r",), ephemeral=True), "ephemeral"),
        (MTP, "neither exchanged nor declared ephemeral"),
        (CacheDeclaration(name="r", kind="circular_buffer", layer_names=("r",)), "neither exchanged nor"),
        (
            CacheDeclaration(name="i", kind="indexer", layer_names=("i",), ephemeral=True),
            "declared ephemeral, but only draft and scratch",
        ),
        (attrs.evolve(TARGET[0], ephemeral=True, draft=True), "declared ephemeral, yet exchanged"),
        (attrs.evolve(TARGET[0], kind="mla"), "exchanged as kind ['full_attention'], declared 'mla'"),
        (attrs.evolve(TARGET[0], layer_names=(*TARGET[0].layer_names, "gone")), "layers ['gone'] are not exchanged"),
        (CacheDeclaration(name="x", kind="compressed", layer_names=("x",), ephemeral=True), "kind: expected one of"),
    ],
)
def test_each_disposition(cache: CacheDeclaration, disposition: str) -> None:
    assert get_cache_disposition(cache, GROUPS).startswith(disposition)


def test_only_draft_and_scratch_may_be_ephemeral() -> None:
    assert may_be_ephemeral(MTP)
    assert may_be_ephemeral(CacheDeclaration(name="r", kind="circular_buffer", layer_names=("r",)))
    for kind in CACHE_KINDS[:-1]:
        assert not may_be_ephemeral(CacheDeclaration(name="k", kind=kind, layer_names=("k",)))


def test_vllm_54926_both_sides_omit_the_draft_groups() -> None:
    # Equal groups on both sides: HS-1 alone passes; the declaration shows the draft KV goes nowhere.
    config = _declaring(MTP)
    with pytest.raises(CacheAccountingError, match=r"'mtp' \(kind full_attention, draft, 1 layers\): neither"):
        check_cache_accounting(config)
    with pytest.raises(CacheAccountingError, match=r"^producer: .*\(CACHE-1\): .*'mtp'"):
        check_compatibility(producer=_descriptor(config), consumer=_descriptor(config, "C"))
    # Without the declaration (protocol 1.2) the same pair passes: what the rule adds.
    check_compatibility(producer=_descriptor(CONFIG), consumer=_descriptor(CONFIG, "C"))


def test_an_unknown_kind_is_refused_naming_the_field_and_the_known_kinds() -> None:
    odd = CacheDeclaration(name="c", kind="compressed_state", layer_names=("c.0",), draft=True, ephemeral=True)
    with pytest.raises(CacheAccountingError) as info:
        check_cache_accounting(_declaring(odd))
    message = str(info.value)
    assert "caches[2] cache 'c'" in message
    assert f"kind: expected one of {list(CACHE_KINDS)}, got 'compressed_state'" in message


def test_a_group_no_declaration_holds_is_refused() -> None:
    with pytest.raises(CacheAccountingError, match=r"groups\[1\] \(kind sliding_window\): exchanged, but no"):
        check_cache_accounting(attrs.evolve(CONFIG, caches=TARGET[:1]))
    assert get_cache_problems(TARGET, GROUPS) == {}


def test_sets_that_differ_are_refused_naming_each_cache() -> None:
    ring = CacheDeclaration(name="ring", kind="circular_buffer", layer_names=("ring.0",), ephemeral=True)
    ephemeral = attrs.evolve(MTP, ephemeral=True)
    producer, consumer = _declaring(ephemeral), _declaring(ring)
    check_cache_accounting(producer)
    check_cache_accounting(consumer)
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatibility(producer=_descriptor(producer), consumer=_descriptor(consumer, "C"))
    assert info.value.differences == {"caches['mtp']": ("declared", "absent"), "caches['ring']": ("absent", "declared")}
    p = {c.name: c for c in producer.caches}
    c = {**p, "mtp": attrs.evolve(ephemeral, kind="sliding_window")}
    assert get_cache_differences(p, c) == {"caches['mtp'].kind": ("full_attention", "sliding_window")}


def test_a_peer_without_declarations_is_compared_by_its_groups_only() -> None:
    # A 1.2 peer's descriptor lacks the field: today's meaning, its groups are its whole set (CACHE-1 clause 6).
    declared = _descriptor(_declaring(attrs.evolve(MTP, ephemeral=True)))
    body = json.loads(encode(_descriptor(CONFIG, "C")))
    assert body.pop("caches") is None
    body["v"] = [1, 2]
    older = decode(json.dumps(body).encode())
    assert isinstance(older, EngineDescriptor)
    assert older.caches is None
    check_compatibility(producer=declared, consumer=older)
    check_compatibility(producer=older, consumer=declared)
    # The declaring side is still held to its own accounting.
    with pytest.raises(CacheAccountingError, match="consumer: "):
        check_compatibility(producer=older, consumer=_descriptor(_declaring(MTP), "C"))


def test_declarations_travel_and_bad_ones_are_malformed() -> None:
    descriptor = _descriptor(_declaring(attrs.evolve(MTP, ephemeral=True)))
    assert decode(encode(descriptor)) == descriptor
    body = json.loads(encode(descriptor))
    body["caches"][0]["layer_names"] = []
    with pytest.raises(MalformedMessageError, match="caches"):
        decode(json.dumps(body).encode())
    body["caches"][0] = {"name": "t0", "kind": "full_attention", "layer_names": ["a"], "draft": "yes"}
    with pytest.raises(MalformedMessageError, match="draft"):
        decode(json.dumps(body).encode())


def test_declaration_and_config_validation_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"CacheDeclaration\.kind: expected a non-empty str"):
        CacheDeclaration(name="a", kind="", layer_names=("a",))
    with pytest.raises(ConfigError, match=r"KVCacheConfig\.caches: expected distinct cache names"):
        attrs.evolve(CONFIG, caches=(TARGET[0], attrs.evolve(TARGET[1], name="t0")))


def test_every_kind_of_the_rule_can_be_exchanged_or_declared() -> None:
    # MLA, an indexer (its own page geometry), chunked local and an exchanged draft group, plus ephemeral ones.
    config = make_config(mla(4), indexer(4), chunked(8, 4), full(4), num_blocks=8)
    groups = get_group_keys(config)
    assert [kind for kind, _ in groups] == ["mla", "indexer", "chunked_local", "full_attention"]
    caches = [CacheDeclaration(name=f"g{g}", kind=k, layer_names=n) for g, (k, n) in enumerate(groups)]
    caches[3] = attrs.evolve(caches[3], draft=True)
    extra = (
        CacheDeclaration(name="swa", kind="sliding_window_mla", layer_names=("d",), draft=True, ephemeral=True),
        CacheDeclaration(name="ring", kind="circular_buffer", layer_names=("r",), ephemeral=True),
    )
    check_cache_accounting(attrs.evolve(config, caches=(*caches, *extra)))
    pages = [g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups]
    assert pages[1] != pages[0]  # the indexer keeps its own page size
