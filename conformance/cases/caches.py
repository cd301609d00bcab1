"""Cases on every cache a model keeps: exchanged or declared ephemeral, on both sides (CACHE-1)."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvspec import (
    CacheAccountingError,
    CacheDeclaration,
    EngineDescriptor,
    IncompatiblePeerError,
    KVCacheConfig,
    KVSpecError,
    TransferMode,
    format_error,
    is_hma_required,
)
from kvspec.spec import CACHE_KINDS

from .._cases import case
from .._context import CaseContext
from .._scenario import Request, Scenario
from ..configs import chunked, full, indexer, make_config, mla, sw

__all__: list[str] = []

# A target with a sliding window, plus the layers of a draft model (EAGLE/MTP) the configs below keep or leave out.
TARGET = make_config(full(4), sw(8, 4), num_blocks=32)
DRAFT_LAYERS = ("draft.l0", "draft.l1")


def _target_caches(config: KVCacheConfig) -> tuple[CacheDeclaration, ...]:
    # One declaration per group: the target model's caches, all exchanged (CACHE-1).
    return tuple(
        CacheDeclaration(name=f"target.{g}", kind=group.kv_cache_spec.kind.value, layer_names=group.layer_names)
        for g, group in enumerate(config.kv_cache_groups)
    )


def _declaring(config: KVCacheConfig, *extra: CacheDeclaration) -> KVCacheConfig:
    return attrs.evolve(config, caches=(*_target_caches(config), *extra))


def _descriptor(config: KVCacheConfig, engine_id: str) -> EngineDescriptor:
    return EngineDescriptor.from_config(
        engine_id=engine_id, config=config, mode=TransferMode.READ, hma_enabled=is_hma_required(config)
    )


def _refusal(ctx: CaseContext, producer: KVCacheConfig, consumer: KVCacheConfig) -> KVSpecError | None:
    """What the connector under test says of this pair at handshake: the error, or None when it accepts."""
    try:
        ctx.connector.check_peer(_descriptor(producer, "producer"), _descriptor(consumer, "consumer"))
    except KVSpecError as exc:
        return exc
    return None


def _expect_refused(
    ctx: CaseContext, name: str, refused: KVSpecError | None, must_name: Iterable[str], problems: list[str]
) -> None:
    if not isinstance(refused, (CacheAccountingError, IncompatiblePeerError)):
        got = "acceptance" if refused is None else format_error(refused)
        problems.append(f"{name}: expected CacheAccountingError or IncompatiblePeerError at handshake, got {got}")
        return
    missing = [word for word in must_name if word not in str(refused)]
    if missing:
        problems.append(f"{name}: the error does not name {missing}: {format_error(refused)}")


@case("CACHE-1", "draft-groups-omitted")
def _draft_omitted(ctx: CaseContext) -> None:
    """Both sides leave a declared draft cache out of their groups (vLLM #54926): refused at handshake, by name.

    Equal group counts and equal groups pass HS-1; only the declaration shows
    that the draft model's KV is neither exchanged nor declared ephemeral, so
    decode would run the draft from a cache nobody wrote.
    """
    draft = CacheDeclaration(name="mtp", kind="full_attention", layer_names=DRAFT_LAYERS, draft=True)
    config = _declaring(TARGET, draft)
    result = ctx.run(Scenario(config=config, requests=[Request(request_id="r", num_tokens=9)]))
    problems: list[str] = []
    _expect_refused(ctx, "draft groups omitted on both sides", result.refused, ["mtp", "ephemeral"], problems)
    if result.outcomes or result.mismatches:
        problems.append("requests ran or memory changed after a refused handshake")
    if problems:
        raise ctx.fail("CACHE-1: " + "\n".join(problems))


@case("CACHE-1", "unknown-kind-refused")
def _unknown_kind(ctx: CaseContext) -> None:
    """A cache of a kind the rule does not know is refused by name, listing the known kinds, even declared ephemeral.

    A newer model's cache (here a compressed state) that no rule places must
    fail closed: its declaration cannot vouch that the consumer rebuilds it.
    """
    problems: list[str] = []
    for ephemeral in (False, True):
        unknown = CacheDeclaration(
            name="compressor", kind="compressed_state", layer_names=("c.l0",), draft=True, ephemeral=ephemeral
        )
        config = _declaring(TARGET, unknown)
        refused = _refusal(ctx, config, config)
        name = f"unknown kind, ephemeral={ephemeral}"
        _expect_refused(ctx, name, refused, ["compressor", "kind", "compressed_state", *CACHE_KINDS], problems)
    if problems:
        raise ctx.fail("CACHE-1: " + "\n".join(problems))


@case("CACHE-1", "target-cache-not-ephemeral")
def _target_not_ephemeral(ctx: CaseContext) -> None:
    """A target model's cache (an indexer, MLA, state) declared ephemeral instead of exchanged is refused by name.

    ROCm/ATOM #1368: a sparse-attention indexer cache never registered; the
    consumer's indexer then scores keys that never arrived. Only draft and
    scratch caches may be rebuilt by the consumer.
    """
    problems: list[str] = []
    base = make_config(mla(4), num_blocks=32)
    for kind in ("indexer", "mla", "mamba", "sliding_window"):
        left_out = CacheDeclaration(name=f"left.{kind}", kind=kind, layer_names=("x.l0",), ephemeral=True)
        config = _declaring(base, left_out)
        _expect_refused(ctx, f"{kind} declared ephemeral", _refusal(ctx, config, config), [f"left.{kind}"], problems)
    scratch = CacheDeclaration(name="ring", kind="circular_buffer", layer_names=("ring.l0",), ephemeral=True)
    draft = CacheDeclaration(name="eagle", kind="full_attention", layer_names=("eagle.l0",), draft=True, ephemeral=True)
    config = _declaring(base, scratch, draft)
    refused = _refusal(ctx, config, config)
    if refused is not None:
        problems.append(f"scratch and draft caches declared ephemeral must be accepted, got {format_error(refused)}")
    if problems:
        raise ctx.fail("CACHE-1: " + "\n".join(problems))


@case("CACHE-1", "cache-sets-differ")
def _sets_differ(ctx: CaseContext) -> None:
    """Peers whose declared cache sets differ are refused naming each cache, though each side accounts for its own.

    The producer declares a draft cache ephemeral that the consumer does not
    keep, and the consumer a scratch cache the producer lacks: both sides are
    in order alone, yet they run different models.
    """
    draft = CacheDeclaration(name="mtp", kind="full_attention", layer_names=DRAFT_LAYERS, draft=True, ephemeral=True)
    scratch = CacheDeclaration(name="ring", kind="circular_buffer", layer_names=("ring.l0",), ephemeral=True)
    producer, consumer = _declaring(TARGET, draft), _declaring(TARGET, scratch)
    problems: list[str] = []
    refused = _refusal(ctx, producer, consumer)
    _expect_refused(ctx, "different cache sets", refused, ["'mtp'", "'ring'"], problems)
    # The same name on both sides, declared differently: the consumer's draft model keeps a window.
    refused = _refusal(ctx, producer, _declaring(TARGET, attrs.evolve(draft, kind="sliding_window")))
    _expect_refused(ctx, "one cache declared differently", refused, ["'mtp'"], problems)
    if problems:
        raise ctx.fail("CACHE-1: " + "\n".join(problems))


# A model that keeps every kind CACHE-1 names: MLA, an indexer, chunked local, a draft group it exchanges, and a
# draft group and a scratch buffer it declares ephemeral.
EVERY_KIND = make_config(mla(4), indexer(4), chunked(8, 4), full(4), num_blocks=128)
EVERY_KIND_CACHES = (
    CacheDeclaration(name="latent", kind="mla", layer_names=EVERY_KIND.kv_cache_groups[0].layer_names),
    CacheDeclaration(name="indexer", kind="indexer", layer_names=EVERY_KIND.kv_cache_groups[1].layer_names),
    CacheDeclaration(name="local", kind="chunked_local", layer_names=EVERY_KIND.kv_cache_groups[2].layer_names),
    CacheDeclaration(
        name="eagle", kind="full_attention", layer_names=EVERY_KIND.kv_cache_groups[3].layer_names, draft=True
    ),
    CacheDeclaration(name="mtp.swa", kind="sliding_window", layer_names=("mtp.l0",), draft=True, ephemeral=True),
    CacheDeclaration(name="ring", kind="circular_buffer", layer_names=("ring.l0",), ephemeral=True),
)


@case("CACHE-1", "every-kind-moves")
def _every_kind(ctx: CaseContext) -> None:
    """MLA, indexer, chunked-local and an exchanged draft group all land, page by page; the ephemeral ones stay.

    The oracle checks every page of every group: an indexer or draft group
    left out of the transfer (ATOM #1368, vLLM #54926) leaves its pages unwritten.
    """
    config = attrs.evolve(EVERY_KIND, caches=EVERY_KIND_CACHES)
    requests = [
        Request(request_id=f"t{t}-h{h}", num_tokens=t, prefix_hit_tokens=h)
        for t, h in ((5, 0), (9, 4), (16, 0), (17, 8), (23, 4))
    ]
    result = ctx.run(Scenario(config=config, requests=requests))
    ctx.expect(result, loaded=[r.request_id for r in requests], rule="CACHE-1")


@case("CACHE-1", "chunk-boundaries")
def _chunk_boundaries(ctx: CaseContext) -> None:
    """Chunked local needs the chunk the next token is in, from its boundary C*(T//C): every T around a boundary.

    C = 8, B = 4: T = 7, 8, 9, 12, 13, 15, 16, 17, with and without a prefix
    hit. The producer's blocks before the chunk are pruned (vLLM frees them);
    a connector that treats the group as full attention refuses what it
    should move, one that treats it as a window of C moves too much.
    """
    config = make_config(full(4), chunked(8, 4), num_blocks=128)
    cases = [(t, 0) for t in (7, 8, 9, 12, 13, 15, 16, 17)] + [(13, 4), (17, 8), (17, 12)]
    requests = [Request(request_id=f"t{t}-h{h}", num_tokens=t, prefix_hit_tokens=h) for t, h in cases]
    result = ctx.run(Scenario(config=config, requests=requests))
    ctx.expect(result, loaded=[r.request_id for r in requests], rule="CACHE-1")
