"""State groups (Mamba, GDN, KDA) end to end: one slot travels, at the right t, paired by slot (STATE-1 .. STATE-5).

Three kinds of case. Scenario cases play requests through the connector under
test and the backend under test; the page oracle compares every state
tensor's bytes in the consumer's slot (and that its padding is unchanged).
Direct cases call one connector hook with lists a real engine produces and
check what it returns or refuses. Endpoint cases run kvspec's own exchange
endpoints over the backend under test, because where a state stands (STATE-1)
and which slot holds it are the engines' business, with no connector hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs

from kvspec import (
    BlockAlignmentError,
    BlockIds,
    ConsumerState,
    EngineDescriptor,
    IncompatiblePeerError,
    KVSpecError,
    StateProfile,
    TransferMode,
    TransferParams,
    TransferRequest,
    UnsupportedVersionError,
)
from kvspec.connector import pair_with
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint, connect, poll_until
from kvspec.spec.state import get_state_group_indices
from kvspec.testing import ExpectedLoad, PagePool, allocate_pool, check_loaded_pages, fill_background
from kvspec.testing import fill_producer_pages as _fill
from kvspec.transport import Backend, Transport

from .._cases import case
from .._context import CaseContext
from .._scenario import Request, Scenario, connector_replay
from ..configs import full, gdn, make_config, mamba, sw

__all__ = ["run_state_endpoints"]

# Mamba-2 in cache mode 'none': no prefix hit, no scratch.
FA_MAMBA = make_config(full(4), mamba(4), num_blocks=48)
# GDN in align mode with two speculative scratch slots: hits on a multiple of 4 (STATE-4).
GDN_ALIGN = make_config(full(4), gdn(4, cache_mode="align", num_speculative_blocks=2), num_blocks=96)
# State, sliding window and full attention together, in separate tensors and in vLLM's shared padded layout.
HYBRID = make_config(full(4), sw(8, 4), mamba(4, cache_mode="align", num_speculative_blocks=1), num_blocks=96)
HYBRID_SHARED = make_config(
    full(4), sw(8, 4), mamba(4, cache_mode="align", num_speculative_blocks=1), num_blocks=96, layout="shared"
)
# Several state groups, as real models have (3 to 11): Qwen3-Next's three GDN groups before full attention, here
# with two scratch slots each; Hymba's state groups between full attention and a sliding window, shared layout.
SEVERAL = make_config(*[gdn(4, cache_mode="align", num_speculative_blocks=2)] * 3, full(4), num_blocks=160)
SEVERAL_SW = make_config(
    full(4),
    *[mamba(4, cache_mode="align", num_speculative_blocks=1)] * 3,
    sw(8, 4),
    num_blocks=160,
    layout="shared",
)
# State groups of two block sizes: a hit must end on a boundary of each, not only of the first (STATE-4).
TWO_STATE_SIZES = make_config(gdn(4, cache_mode="align"), gdn(8, cache_mode="align"), full(4), num_blocks=32)
CONFIGS = {
    "FA_MAMBA": FA_MAMBA,
    "GDN_ALIGN": GDN_ALIGN,
    "SEVERAL": SEVERAL,
    "SEVERAL_SW": SEVERAL_SW,
    "TWO_STATE_SIZES": TWO_STATE_SIZES,
}


def _modes(ctx: CaseContext) -> list[str]:
    return [m.value for m in (TransferMode.READ, TransferMode.WRITE) if m in ctx.capabilities.modes]


def _profile(ctx: CaseContext, config: object) -> str:
    """The connector's state profile for ``config`` (its ``state_profile`` hook), else "recompute" (STATE-1)."""
    hook = getattr(ctx.connector, "state_profile", None)
    answer = hook(config) if callable(hook) else None
    return str(getattr(answer, "value", answer)) if answer is not None else "recompute"


def _play(
    ctx: CaseContext, config: object, requests: Sequence[Request], rule: str, *, modes: Sequence[str] | None = None
) -> None:
    """Every request LOADED in every mode (or in ``modes``), the state slot byte-exact (the page oracle).

    Under the connector's own state profile: a "prebuilt" engine ships the
    state after all N tokens and recomputes none, so there each request runs
    with recomputed_tokens=0, once per (tokens, prefix hit) (STATE-1, decision 187 in decisions-testing.md).
    """
    profile = _profile(ctx, config)
    if profile == "prebuilt":
        seen: dict[tuple[int, int], Request] = {}
        for r in requests:
            seen.setdefault((r.num_tokens, r.prefix_hit_tokens), attrs.evolve(r, recomputed_tokens=0))
        requests = list(seen.values())
    for mode in _modes(ctx) if modes is None else modes:
        scenario = Scenario(config=config, mode=mode, requests=tuple(requests), state_profile=profile)  # type: ignore[arg-type]
        result = ctx.run(scenario)
        ctx.expect(result, loaded=[r.request_id for r in requests], rule=f"{rule} ({mode})")


# --------------------------------------------------------------------------- scenario cases


@case("STATE-1", "recomputed-tokens-0-to-3")
def _recomputed(ctx: CaseContext) -> None:
    """C recomputing b in {0, 1, 2, 3} tokens: the state of T tokens lands in C's one slot, byte-exact.

    The lists cover T + b tokens, so the state group lists cdiv(T + b, B)
    slots (nulls but the last) plus two scratch slots; the state after T
    tokens (t == T) must land whatever b is.
    """
    requests = [Request(request_id=f"t{t}-b{b}", num_tokens=t, recomputed_tokens=b) for t in (8, 10) for b in range(4)]
    _play(ctx, GDN_ALIGN, requests, "STATE-1")


@case("STATE-2", "one-slot-moves")
def _one_slot(ctx: CaseContext) -> None:
    """Mamba-2 beside full attention: exactly the last state slot moves, on and off block boundaries."""
    requests = [Request(request_id=f"t{t}", num_tokens=t) for t in (3, 4, 5, 9, 12)]
    _play(ctx, FA_MAMBA, requests, "STATE-2")


@case("STATE-2", "scratch-slots-never-travel")
def _scratch(ctx: CaseContext) -> None:
    """Speculative scratch slots at the tail of P's state list never travel: the slot before them does."""
    requests = [
        Request(request_id=f"t{t}-b{b}", num_tokens=t, recomputed_tokens=b) for t in (1, 4, 6, 9) for b in (0, 1)
    ]
    _play(ctx, GDN_ALIGN, requests, "STATE-2")


@case("STATE-2", "state-window-and-full")
def _hybrid(ctx: CaseContext) -> None:
    """State, sliding window and full attention in one model, separate and shared padded tensors, with hits.

    The sliding-window group clips to its window, the state group to its one
    slot; an align-mode hit on a multiple of 4 leaves the state and the
    window's tail to move (STATE-2, STATE-4, CLIP-1).
    """
    requests = [
        Request(request_id=f"t{t}-b{b}-h{h}", num_tokens=t, recomputed_tokens=b, prefix_hit_tokens=h)
        for t, b, h in ((9, 0, 0), (14, 1, 0), (13, 2, 4), (16, 3, 8), (21, 1, 12))
    ]
    for config in (HYBRID, HYBRID_SHARED):
        _play(ctx, config, requests, "STATE-2")


@case("STATE-3", "several-state-groups")
def _several(ctx: CaseContext) -> None:
    """Three state groups beside full attention (and, in shared padded tensors, a window): each its own slot moves.

    Each state group's slot travels into the consumer's slot of that group,
    its scratch slots never, with recomputed tokens and align-mode hits; a
    connector that pairs, clips or places only the first state group right
    leaves the others' slots stale or filled from another slot (STATE-2,
    STATE-3, STATE-4).
    """
    requests = [
        Request(request_id=f"t{t}-b{b}-h{h}", num_tokens=t, recomputed_tokens=b, prefix_hit_tokens=h)
        for t, b, h in ((14, 1, 0), (13, 2, 4), (21, 1, 12))
    ]
    # Each config in one mode, READ then WRITE where both are claimed: both pairings (C's, and P's of a WRITE
    # offer) see several state groups, at half the scenarios of every config in every mode.
    modes = _modes(ctx)
    for i, config in enumerate((SEVERAL, SEVERAL_SW)):
        _play(ctx, config, requests, "STATE-3", modes=modes[i % len(modes) :][:1])


@case("STATE-4", "align-prefix-hits")
def _align_hits(ctx: CaseContext) -> None:
    """Align-mode prefix hits on state boundaries: the state still moves; a full hit moves nothing."""
    requests = [
        *(Request(request_id=f"h{h}", num_tokens=13, recomputed_tokens=1, prefix_hit_tokens=h) for h in (4, 8, 12)),
        Request(request_id="full-hit", num_tokens=12, prefix_hit_tokens=12),
    ]
    _play(ctx, GDN_ALIGN, requests, "STATE-4")


# --------------------------------------------------------------------------- direct cases


def _direct(ctx: CaseContext, call: str) -> None:
    """A reproducer that calls the connector under test (``connector.<call>``) as the case did."""
    replay = connector_replay(ctx.connector)
    imports, built = (
        replay if replay is not None else ("from kvspec.connector import ReferenceConnector\n", "ReferenceConnector()")
    )
    ctx.last_reproducer = (
        f"from kvspec import BlockIds\nfrom kvspec_conformance.cases import state\n{imports}\n"
        f"connector = {built}\nprint(connector.{call})\n"
    )


def _clip(ctx: CaseContext, ids: list[list[int]], config_name: str = "GDN_ALIGN") -> object:
    _direct(ctx, f"clip_block_ids(state.{config_name}, BlockIds({ids!r}))")
    try:
        return tuple(tuple(g) for g in ctx.connector.clip_block_ids(CONFIGS[config_name], BlockIds(ids)))
    except KVSpecError as exc:
        return exc


@case("STATE-2", "clip-keeps-the-state-slot")
def _clip_state(ctx: CaseContext) -> None:
    """The clip drops min(2, len - 1) scratch slots and keeps the last slot; a null kept slot is refused.

    With several state groups (three GDN groups before full attention) each
    group keeps its own slot, whatever the first group's list holds.
    """
    problems = []
    # (P's table, the state slot that must be kept); two scratch slots (num_speculative_blocks=2).
    for table, kept in (
        ([[1, 2, 3], [0, 0, 7, 8, 9]], 7),
        ([[1], [5]], 5),
        ([[1], [5, 6]], 5),
        ([[1, 2], [0, 5, 6, 8]], 5),
    ):
        got = _clip(ctx, table)
        if got != ((*table[0],), (kept,)):
            problems.append(f"clip_block_ids({table}): expected [{table[0]}, [{kept}]], got {got}")
    # Three state groups of different list lengths (STATE-2 applies to each group on its own).
    several = [[0, 0, 7, 8, 9], [0, 0, 0, 12, 13, 14], [15, 16, 17], [1, 2, 3]]
    got = _clip(ctx, several, "SEVERAL")
    if got != ((7,), (12,), (15,), (1, 2, 3)):
        problems.append(f"SEVERAL: clip_block_ids({several}): expected [[7], [12], [15], [1, 2, 3]], got {got}")
    # Scratch dropped, the slot left is the null block: a missing state, never an empty transfer.
    for table, name in (([[1, 2], [0, 8, 9]], "GDN_ALIGN"), ([[1], [0, 8]], "GDN_ALIGN")):
        got = _clip(ctx, table, name)
        if not isinstance(got, BlockAlignmentError):
            problems.append(f"clip_block_ids({table}): expected StateSlotError (a null state slot), got {got}")
    # The third state group's slot is the null block: refused whatever the first group holds.
    table = [[0, 7, 8, 9], [0, 12, 13, 14], [0, 15, 16], [1, 2, 3]]
    got = _clip(ctx, table, "SEVERAL")
    if not isinstance(got, BlockAlignmentError):
        problems.append(f"SEVERAL: clip_block_ids({table}): expected StateSlotError (group 2's slot), got {got}")
    if problems:
        raise ctx.fail("STATE-2: " + "\n".join(problems))


def _pair(
    ctx: CaseContext,
    config_name: str,
    producer: list[list[int]],
    consumer: list[list[int]],
    *,
    num_tokens: int,
    hit: int,
) -> object:
    config = CONFIGS[config_name]
    _direct(
        ctx,
        f"pair_block_ids(state.{config_name}, TransferRequest(num_tokens={num_tokens}, prefix_hit_tokens={hit}, "
        f"producer_block_ids=BlockIds({producer!r}), consumer_block_ids=BlockIds({consumer!r})))",
    )
    try:
        request = TransferRequest(
            num_tokens=num_tokens,
            prefix_hit_tokens=hit,
            producer_block_ids=BlockIds(producer),
            consumer_block_ids=BlockIds(consumer),
        )
        pairs = pair_with(ctx.connector, config, request)
    except KVSpecError as exc:
        return exc
    # Per state group in order: its one (P slot, C slot) pair, or both lists where it is not one pair (STATE-3).
    found: list[object] = []
    for g in get_state_group_indices(config):
        p, c = tuple(pairs.producer_block_ids[g]), tuple(pairs.consumer_block_ids[g])
        found.append((p[0], c[0]) if len(p) == len(c) == 1 else (p, c))
    return tuple(found)


@case("STATE-3", "slots-pair-last-with-last")
def _pair_last(ctx: CaseContext) -> None:
    """P's last slot pairs with C's last; C may list one more slot (its recomputed token's), not two.

    With several state groups each group pairs its own slots: three GDN
    groups before full attention, lists of different lengths, scratch slots.
    """
    problems = []
    for name, producer, consumer, hit, want in (
        ("FA_MAMBA", [[1, 2, 3], [0, 0, 7]], [[4, 5, 6], [9]], 0, ((7, 9),)),
        ("FA_MAMBA", [[1, 2, 3], [7]], [[4, 5, 6], [8, 9]], 0, ((7, 9),)),
        # A consumer prefix hit: P's tail, past its two scratch slots (STATE-2, STATE-4).
        ("GDN_ALIGN", [[1, 2, 3], [0, 0, 7, 20, 21]], [[6], [9]], 8, ((7, 9),)),
        # Several state groups, unclipped on both sides: each group's last slot before its scratch pairs.
        (
            "SEVERAL",
            [[0, 0, 7, 20, 21], [0, 8, 22, 23], [9, 24, 25], [1, 2, 3]],
            [[10], [11, 12], [13], [4, 5, 6]],
            0,
            ((7, 10), (8, 11), (9, 13)),
        ),
        # The same after a prefix hit of 8 tokens: C lists the full group's last block only.
        (
            "SEVERAL",
            [[0, 0, 7, 20, 21], [0, 0, 8, 22, 23], [0, 0, 9, 24, 25], [1, 2, 3]],
            [[10], [11], [13], [6]],
            8,
            ((7, 10), (8, 11), (9, 13)),
        ),
    ):
        got = _pair(ctx, name, producer, consumer, num_tokens=9, hit=hit)
        if got != want:
            problems.append(f"{name} P {producer} C {consumer} hit {hit}: expected state pairs {want}, got {got}")
    got = _pair(ctx, "FA_MAMBA", [[1, 2, 3], [7]], [[4, 5, 6], [8, 9, 10]], num_tokens=9, hit=0)
    if not isinstance(got, BlockAlignmentError):
        problems.append(f"a consumer listing two more state slots than P: expected StateSlotError, got {got}")
    if problems:
        raise ctx.fail("STATE-3: " + "\n".join(problems))


@case("STATE-3", "null-state-slot-refused")
def _null_slot(ctx: CaseContext) -> None:
    """A null state slot on either side is refused before pairing: it would move nothing, or the null block."""
    problems = []
    for producer, consumer in (
        ([[1, 2], [5, 0]], [[3, 4], [6]]),
        ([[1, 2], [0]], [[3, 4], [6]]),
        ([[1, 2], [5]], [[3, 4], [0]]),
    ):
        got = _pair(ctx, "FA_MAMBA", producer, consumer, num_tokens=8, hit=0)
        if not isinstance(got, BlockAlignmentError):
            problems.append(f"P {producer} C {consumer}: expected StateSlotError (a null state slot), got {got}")
    if problems:
        raise ctx.fail("STATE-3: " + "\n".join(problems))


@case("STATE-4", "hit-off-a-state-boundary-refused")
def _off_boundary(ctx: CaseContext) -> None:
    """An align hit off a multiple of B, or any hit in cache mode 'none', is refused: no state is cached there."""
    problems = []
    for name, producer, consumer, hit in (
        ("GDN_ALIGN", [[1, 2, 3], [0, 0, 7]], [[6], [9]], 10),
        ("GDN_ALIGN", [[1, 2, 3], [0, 0, 7]], [[5, 6], [9]], 6),
        ("FA_MAMBA", [[1, 2, 3], [0, 0, 7]], [[6], [9]], 8),
        # On the first state group's boundary (4) but not the second's (8): every state group decides.
        ("TWO_STATE_SIZES", [[0, 0, 7], [0, 8], [1, 2, 3]], [[9], [10], [5, 6]], 4),
    ):
        got = _pair(ctx, name, producer, consumer, num_tokens=11, hit=hit)
        if not isinstance(got, BlockAlignmentError):
            problems.append(f"{name} hit {hit}: expected BlockAlignmentError (STATE-4), got {got}")
    if problems:
        raise ctx.fail("STATE-4: " + "\n".join(problems))


def _descriptor(config: object, profile: str) -> EngineDescriptor:
    return EngineDescriptor.from_config(
        engine_id="e",
        config=config,  # type: ignore[arg-type]
        mode=TransferMode.READ,
        hma_enabled=True,
        state_profile=StateProfile(profile),
    )


@case("STATE-5", "state-layouts-must-match")
def _layouts(ctx: CaseContext) -> None:
    """Peers whose state shapes, dtypes, kind or conv layout differ are refused by name; cache mode may differ."""
    # Both peers of the connector's own profile: a profile mismatch is STATE-1's, not this case's (decision 187 in
    # decisions-testing.md).
    profile = _profile(ctx, GDN_ALIGN)
    base = _descriptor(GDN_ALIGN, profile)
    state = get_state_group_indices(GDN_ALIGN)[0]
    group = base.groups[state]
    changes: dict[str, object] = {
        "state_shapes": ((2, 2), (2, 2)),
        "state_dtypes": ("int8", "uint8"),
        "mamba_type": "kda",
        "conv_layout": "SD",
    }
    problems = []
    ctx.last_reproducer = None
    for field, value in changes.items():
        groups = list(base.groups)
        groups[state] = attrs.evolve(group, **{field: value})  # type: ignore[arg-type]
        try:
            ctx.connector.check_peer(base, attrs.evolve(base, groups=tuple(groups)))
        except (IncompatiblePeerError, UnsupportedVersionError) as exc:
            if field not in str(exc):
                problems.append(f"{field} differs: refused, but the error does not name it: {exc}")
        except KVSpecError as exc:
            problems.append(f"{field} differs: expected IncompatiblePeerError, got {type(exc).__name__}: {exc}")
        else:
            problems.append(f"{field} differs ({getattr(group, field)!r} vs {value!r}): accepted (STATE-5)")
    other = _descriptor(make_config(full(4), gdn(4), num_blocks=96), profile)  # cache mode 'none', no scratch slots
    try:
        ctx.connector.check_peer(base, other)
    except KVSpecError as exc:
        problems.append(f"only cache mode and scratch slots differ, each side's own: refused: {exc}")
    if problems:
        raise ctx.fail("STATE-5: " + "\n".join(problems))


@case("STATE-1", "state-profiles-refused-at-handshake")
def _profiles(ctx: CaseContext) -> None:
    """Peers of different state profiles (recompute, prebuilt) are refused at the handshake, before any byte moves.

    Three state groups beside full attention; the consumer's descriptor
    says the other profile. The refusal is an IncompatiblePeerError naming
    ``state_profile``: no rule turns one engine's state into the other's
    (STATE-1, decision 99 in decisions-state.md). The oracle then finds both pools untouched. One
    mode: the profile is compared the same way in both.
    """
    own = _profile(ctx, SEVERAL)
    other = "prebuilt" if own == "recompute" else "recompute"
    problems = []
    for mode in _modes(ctx)[:1]:
        scenario = Scenario(
            config=SEVERAL,
            mode=mode,
            requests=(Request(request_id="r", num_tokens=8),),
            state_profile=own,
            handshake_overrides=(("state_profile", other),),
        )
        result = ctx.run(scenario)
        refused = result.refused
        if refused is None:
            problems.append(f"{mode}: producer {own!r}, consumer {other!r}: accepted; expected IncompatiblePeerError")
        elif not isinstance(refused, IncompatiblePeerError) or "state_profile" not in refused.differences:
            problems.append(f"{mode}: refused, but not naming state_profile: {type(refused).__name__}: {refused}")
        if result.outcomes or result.mismatches:
            moved = [f"{o.request_id}: consumer {o.consumer_state.value}" for o in result.outcomes.values()]
            problems.append(f"{mode}: requests ran or pages changed: {moved}, {len(result.mismatches)} pages differ")
    if problems:
        raise ctx.fail("STATE-1: " + "\n".join(problems))


# --------------------------------------------------------------------------- endpoint cases

ENDPOINT_CONFIG = make_config(full(4), sw(8, 4), gdn(4, cache_mode="align", num_speculative_blocks=1), num_blocks=64)
# (request id, T, the t the producer declares; None: its default, T).
AT_T: tuple[tuple[str, int, int | None], ...] = (("t3", 3, None), ("t8", 8, None), ("t10", 10, 10), ("t13", 13, None))
OFF_T: tuple[tuple[str, int, int | None], ...] = (("late", 9, 10), ("early", 9, 8), ("zero", 5, 0))
SLOTS: tuple[tuple[str, int, int | None], ...] = (("s4", 4, None), ("s9", 9, None), ("s12", 12, None))


def _snapshot(pool: PagePool) -> list[bytes]:
    return [bytes(r.buffer) for r in pool.regions]


def run_state_endpoints(
    backend: Backend | str = "loopback",
    *,
    mode: str = "read",
    requests: Sequence[tuple[str, int, int | None]] = AT_T,
    time_scale: float = 1.0,
) -> list[str]:
    """Run ``requests`` one by one through kvspec's endpoints; the problems found (STATE-1, STATE-3).

    A request whose declared t equals T must load with C's state slot byte-
    exact to what P's fill wrote into the slot it advertised; any other t must
    be refused before a byte moves into C's pool.
    """
    if isinstance(backend, str):
        from kvspec.transport import load_backend

        loaded = load_backend(backend)
        try:
            return run_state_endpoints(loaded, mode=mode, requests=requests, time_scale=time_scale)
        finally:
            loaded.close()
    problems: list[str] = []
    config = ENDPOINT_CONFIG
    with allocate_pool(config) as p_pool, allocate_pool(config) as c_pool:
        fill_background(p_pool, seed="producer")
        fill_background(c_pool, seed="consumer")
        agents: list[Transport] = []
        try:
            agents += [backend.create_agent("producer"), backend.create_agent("consumer")]
            producer = ProducerEndpoint(
                engine_id="producer",
                config=config,
                transport=agents[0],
                regions=p_pool.regions,
                mode=TransferMode(mode),
            )
            consumer = ConsumerEndpoint(
                engine_id="consumer",
                config=config,
                transport=agents[1],
                regions=c_pool.regions,
                mode=TransferMode(mode),
                transfer_timeout=2.0 * time_scale,
                drain_timeout=0.1 * time_scale,
            )
            connect(producer, consumer)
            for rid, tokens, declared in requests:
                problems += _one(producer, consumer, c_pool, p_pool, rid, tokens, declared, time_scale)
            # A refused request's check fault is the point; any other fault is a problem.
            loading = {rid for rid, tokens, declared in requests if declared in (None, tokens)}
            for endpoint in (producer, consumer):
                problems += [f"{endpoint.engine_id}: {f}" for f in endpoint.errors if f.request_id in loading]
        except KVSpecError as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            for agent in agents:
                agent.close()
    return problems


def _one(
    producer: ProducerEndpoint,
    consumer: ConsumerEndpoint,
    c_pool: PagePool,
    p_pool: PagePool,
    rid: str,
    tokens: int,
    declared: int | None,
    scale: float,
) -> list[str]:
    fill: Callable[[BlockIds], None] = lambda ids: _fill(p_pool, ids, num_tokens=tokens, salt=rid)  # noqa: E731
    params = producer.prefill(rid, num_tokens=tokens, fill=fill, state_tokens=declared)
    before = _snapshot(c_pool)
    consumer.begin(TransferParams.from_kv_transfer_params(params.to_kv_transfer_params()))

    def both() -> None:
        consumer.poll()
        producer.poll()

    poll_until(
        both,
        done=lambda: producer.result(rid) is not None and consumer.result(rid) is not None,
        until=time.monotonic() + 10.0 * scale,
    )
    ended = consumer.result(rid)
    if ended is None or producer.result(rid) is None:
        return [f"{rid}: did not end on both sides within {10.0 * scale:.0f} s"]
    expect_load = declared is None or declared == tokens
    if not expect_load:
        problems = []
        if ended.state is not ConsumerState.FAILED or ended.failure is None:
            problems.append(f"{rid}: P declared t={declared} for T={tokens}: expected FAILED, got {ended.state.value}")
        if _snapshot(c_pool) != before:
            problems.append(f"{rid}: P declared t={declared} for T={tokens}, yet bytes moved into C's pool (STATE-1)")
        return problems
    if ended.state is not ConsumerState.LOADED:
        detail = ended.failure.detail if ended.failure is not None else ""
        return [f"{rid}: T={tokens}, P's t={params.state_tokens}: expected LOADED, got {ended.state.value}: {detail}"]
    problems = []
    if params.state_tokens != tokens:
        problems.append(f"{rid}: P declared state_tokens={params.state_tokens} for T={tokens}; expected T (STATE-1)")
    load = ExpectedLoad(
        producer_block_ids=params.producer_block_ids,
        consumer_block_ids=ended.consumer_block_ids,
        num_tokens=tokens,
        salt=rid,
    )
    found = check_loaded_pages(c_pool, load)
    problems += [f"{rid}: {m}" for m in found[:6]]
    consumer.finish(rid)
    return problems


def _endpoints(ctx: CaseContext, requests: tuple[tuple[str, int, int | None], ...], rule: str, name: str) -> None:
    for mode in _modes(ctx):
        ctx.last_reproducer = (
            "from kvspec_conformance.cases.state import run_state_endpoints, " + name + "\n\n"
            f"print(run_state_endpoints({ctx.backend_spec!r}, mode={mode!r}, requests={name}, "
            f"time_scale={ctx.time_scale!r}))\n"
        )
        problems = run_state_endpoints(ctx.backend, mode=mode, requests=requests, time_scale=ctx.time_scale)
        if problems:
            raise ctx.fail(f"{rule} ({mode}, kvspec's exchange endpoints):\n" + "\n".join(problems))


@case("STATE-1", "endpoints-state-at-t-loads", requires=["local_pools", "notifications"])
def _endpoints_at_t(ctx: CaseContext) -> None:
    """kvspec's endpoints: P declares t == T, C resumes at T: the state slot loads byte-exact."""
    _endpoints(ctx, AT_T, "STATE-1", "AT_T")


@case("STATE-1", "endpoints-state-off-t-refused", requires=["local_pools", "notifications"])
def _endpoints_off_t(ctx: CaseContext) -> None:
    """kvspec's endpoints: a state one token late, one early or empty (t != T) is refused; no byte moves."""
    _endpoints(ctx, OFF_T, "STATE-1", "OFF_T")


@case("STATE-3", "endpoints-advertised-slot-holds-the-state", requires=["local_pools", "notifications"])
def _endpoints_slot(ctx: CaseContext) -> None:
    """kvspec's endpoints: the slot P advertised holds the state until C's copy of it is done."""
    _endpoints(ctx, SLOTS, "STATE-3", "SLOTS")
