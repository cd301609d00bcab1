"""Offload cases: store, evict and reload through the backend under test, checked byte by byte (OFF-1 ... OFF-9).

Every case plays an :class:`OffloadScenario` (``conformance/_offload_scenario.py``):
the suite owns a GPU pool and a chunk pool, the connector under test decides
what each step stores, how long each hit is, what it loads and which
sub-block each block pairs with, and the backend moves the bytes. The
oracle checks both pools after every copy, by logical position, and the
hit against a naive model of OFF-5. The connector's offload hooks are its
own when it implements :class:`kvspec_conformance.OffloadConnector`, else
kvspec's reference, so these cases check a backend's copies either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
from hypothesis import example, given
from hypothesis import strategies as st

from kvspec import ConfigError, KVSpecError, OffloadConfig, UnsupportedHybridError
from kvspec.connector import OffloadConnector, ReferenceOffloadConnector, as_offload_connector

from .._cases import case
from .._context import CaseContext
from .._offload_scenario import (
    OffloadRequest,
    OffloadResult,
    OffloadScenario,
    expected_load_positions,
    run_offload_scenario,
)
from .._scenario import connector_replay
from ..configs import full, make_config, mamba, sw

__all__ = ["run_offload"]

# vLLM's HMA test geometry (docs/spec/offload.md, OFF-3 and OFF-5 tables): full attention and a window of 8, B = 4.
FULL_SW = make_config(full(4), sw(8, 4), num_blocks=128)
# vLLM's different-block-sizes test: two full-attention groups, B = 12 and 16, h = 4, f = 1.
MIXED = make_config(full(12), full(16), num_blocks=128)


def _hooks(ctx: CaseContext) -> OffloadConnector:
    return as_offload_connector(ctx.connector)


def run_offload(ctx: CaseContext, scenario: OffloadScenario, *, rule: str) -> OffloadResult:
    """Play ``scenario`` with the connector under test; fail the case with every problem the oracle found."""
    hooks = _hooks(ctx)
    connector = connector_replay(ctx.connector)
    if ctx.time_scale != 1.0:
        scenario = attrs.evolve(scenario, deadline=scenario.deadline * ctx.time_scale)
    ctx.last_reproducer = scenario.to_python(ctx.backend_spec, connector)
    result = run_offload_scenario(scenario, backend=ctx.backend, connector=hooks)
    if result.problems:
        raise ctx.fail(f"{rule}: " + "\n".join(result.problems) + "\n\nscenario result:\n" + result.summary())
    return result


def _expect_hits(ctx: CaseContext, result: OffloadResult, wanted: dict[str, tuple[int, ...]], rule: str) -> None:
    """With the reference offload logic, the hits the case's docstring pins (values from vLLM's tests and the spec).

    They prove the scenario reaches the state it is about. A connector under
    test may hit less (OFF-5 forbids only longer hits, which the oracle
    checks on every lookup; ``OFF-5/hit-as-long-as-the-rule`` asks for the
    rule's hits), so its hits are not compared with these.
    """
    if type(_hooks(ctx)) is not ReferenceOffloadConnector:
        return
    got = {rid: result.hits[rid] for rid in wanted}
    if got != wanted:
        raise ctx.fail(f"{rule}: expected hits {wanted}, got {got}\n\nscenario result:\n" + result.summary())


# --------------------------------------------------------------------------- OFF-1 geometry


@case("OFF-1", "different-block-sizes-f1", requires=["local_pools"])
def _different_block_sizes(ctx: CaseContext) -> None:
    """Two groups of different block sizes (12, 16) with f = 1: stores to 96 tokens, loads of 48 and 80 land.

    vLLM's ``test_two_groups_different_block_sizes``: a 25-token prompt
    decoded to 96 tokens stores chunks 0-7 and 0-5; a 48-token request hits
    all 48 tokens, and an 85-token request with a 48-token GPU hit loads up
    to M = min(85, 7 * 12, 5 * 16) = 80.
    """
    scenario = OffloadScenario(
        config=MIXED,
        hash_block_size=4,
        requests=[
            OffloadRequest(request_id="writer", num_tokens=25, decode_tokens=71),
            OffloadRequest(request_id="r48", num_tokens=48),
            OffloadRequest(request_id="r85", num_tokens=85, local_hit_tokens=48),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-1")
    _expect_hits(ctx, result, {"r48": (48,), "r85": (32,)}, "OFF-1")


@case("OFF-1", "mixed-block-sizes-refuse-f-above-1", requires=["local_pools"])
def _mixed_refused(ctx: CaseContext) -> None:
    """f = 2 with groups of block sizes 12 and 16 is refused with ConfigError before anything is stored."""
    hooks = _hooks(ctx)
    offload = OffloadConfig(blocks_per_chunk=2, hash_block_size=4)
    try:
        hooks.get_store_set(
            MIXED, [[1, 2], [3, 4]], request_id="r", num_offloadable_tokens=24, next_chunk=(0, 0), offload=offload
        )
    except ConfigError:
        return
    except KVSpecError as exc:
        raise ctx.fail(f"OFF-1: expected ConfigError for f = 2 with block sizes 12 and 16, got {exc!r}") from None
    raise ctx.fail("OFF-1: a store set with f = 2 over block sizes 12 and 16 was accepted (vLLM asserts f = 1)")


# --------------------------------------------------------------------------- OFF-3 store


@case("OFF-3", "two-groups-full-and-window", requires=["local_pools"])
def _full_and_window(ctx: CaseContext) -> None:
    """Full attention + window 8 (B = 4, f = 1): a 12-token prompt decoded 15 tokens stores chunks 0-5 of both.

    vLLM's ``test_two_groups_full_and_sliding_window``: a 13-token request
    then hits 12 tokens and loads (0,0) (0,1) (0,2) (1,1) (1,2); a 17-token
    request with a 12-token GPU hit loads (0,3) (1,3).
    """
    scenario = OffloadScenario(
        config=FULL_SW,
        requests=[
            OffloadRequest(request_id="writer", num_tokens=12, decode_tokens=15),
            OffloadRequest(request_id="r13", num_tokens=13),
            OffloadRequest(request_id="r17", num_tokens=17, local_hit_tokens=12),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-3")
    _expect_hits(ctx, result, {"r13": (12,), "r17": (4,)}, "OFF-3")
    reference = type(_hooks(ctx)) is ReferenceOffloadConnector
    if reference and (result.stored_pages != 12 * 2 or result.loaded_pages != (5 + 2) * 2):
        raise ctx.fail(
            f"OFF-3: expected 24 pages stored (6 chunks of 2 groups, 2 layers) and 14 loaded, got "
            f"{result.stored_pages} and {result.loaded_pages}\n\n{result.summary()}"
        )


# f = 3, B = 4, W = 8 (C_g = 12): R1 (40 tokens) has a 28-token GPU hit, so its window blocks 0-4 are null and
# window chunk 1 (blocks 3-5) is written only in sub-block 2; #42945 counted 6 blocks for the 4 sources.
STRADDLE = make_config(full(4), sw(8, 4), num_blocks=128)
_STRADDLE_REQUESTS = (
    OffloadRequest(request_id="r1", num_tokens=40, local_hit_tokens=28),
    OffloadRequest(request_id="r2", num_tokens=25),
    OffloadRequest(request_id="r3", num_tokens=40),
)


@case("OFF-3", "chunk-straddling-window-edge", requires=["local_pools"])
def _straddle_store(ctx: CaseContext) -> None:
    """A window chunk straddling the null prefix is stored in part; its count never includes the nulls (#42945).

    f = 3, B = 4, W = 8: a 40-token request with a 28-token GPU hit has
    window blocks 0-4 null; its store offers window chunks 1 and 2 with
    sources from block 5 on (first index 5, count 4).
    """
    scenario = OffloadScenario(config=STRADDLE, blocks_per_chunk=3, requests=_STRADDLE_REQUESTS)
    run_offload(ctx, scenario, rule="OFF-3")


@case("OFF-3", "window-chunks-all-stored", level="SHOULD", requires=["local_pools"])
def _window_all_stored(ctx: CaseContext) -> None:
    """Every complete window chunk whose last block is real is offered, not only the window's tail (OFF-3).

    A store that clips a window group to the window (as the exchange does,
    CLIP-1) or keeps only the chunks a replay of the prompt reads loses later,
    longer hits, never data; the MUST cases judge only what is stored, this
    one asks for all of it (decision 56 in decisions-offload.md: vLLM 0.33.0 stores the window's tail).
    """
    for f in (1, 3):
        scenario = OffloadScenario(
            config=STRADDLE,
            blocks_per_chunk=f,
            require_window_stores=True,
            requests=[*_STRADDLE_REQUESTS, OffloadRequest(request_id="long", num_tokens=60, stream="long")],
        )
        run_offload(ctx, scenario, rule="OFF-3")


@case("OFF-3", "store-deferred-past-request-end", requires=["local_pools"])
def _deferred(ctx: CaseContext) -> None:
    """The last step's store is posted after the request finished; it holds only complete chunks, and later hits.

    A 10-token prompt decoded to 14 tokens (B = 4, f = 1) ends with block 3
    half computed: the deferred store offers chunks 0-2 only. Another
    request allocates while that store is in flight; a third one, looking up
    once the store landed, hits 12. A store in flight is not present (OFF-4):
    a lookup while it is in flight may hit only what landed, which the oracle
    checks on every lookup, so the pinned hits wait for the stores to land and
    hold at any backend pace.
    """
    scenario = OffloadScenario(
        config=FULL_SW,
        requests=[
            OffloadRequest(request_id="short", num_tokens=10, decode_tokens=4, defer_last_store=True),
            OffloadRequest(request_id="other", num_tokens=9, stream="other", defer_last_store=True),
            OffloadRequest(request_id="again", num_tokens=14, after_stores_landed=True),
            OffloadRequest(request_id="tail", num_tokens=10, stream="tail", defer_last_store=True),
            OffloadRequest(request_id="between", num_tokens=6, stream="between"),
            OffloadRequest(request_id="tail-again", num_tokens=13, stream="tail", after_stores_landed=True),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-3")
    _expect_hits(ctx, result, {"again": (12,), "tail-again": (8,)}, "OFF-3")


@case("OFF-3", "preempted-mid-store", requires=["local_pools"])
def _preempted(ctx: CaseContext) -> None:
    """A request preempted with a store in flight restarts from its lookup; later stores read its new blocks only.

    Its blocks stay allocated until the in-flight store lands, then return
    to the pool and are handed out again; a connector that kept the
    preempted table (it ignored ``finish_request``) stores another
    position's page (#42761: stale KV offloaded).
    """
    for f in (1, 3):
        scenario = OffloadScenario(
            config=FULL_SW,
            blocks_per_chunk=f,
            requests=[
                OffloadRequest(request_id="p", num_tokens=48, prefill_step=12, decode_tokens=4, preempt_after_steps=2),
                OffloadRequest(request_id="reader", num_tokens=53),
            ],
        )
        run_offload(ctx, scenario, rule="OFF-3")


# --------------------------------------------------------------------------- OFF-4 partial chunks


@case("OFF-4", "partial-chunk-never-loaded", requires=["local_pools"])
def _partial_never_loaded(ctx: CaseContext) -> None:
    """A chunk stored in part is never present: the later 25-token request hits 0, not 24, and loads nothing.

    The docs/spec/offload.md example: loading chunk 1 would read its
    sub-block 1, which no store wrote (tokens 16-19, inside the window).
    """
    scenario = OffloadScenario(config=STRADDLE, blocks_per_chunk=3, requests=_STRADDLE_REQUESTS)
    result = run_offload(ctx, scenario, rule="OFF-4")
    _expect_hits(ctx, result, {"r2": (0,)}, "OFF-4")


# --------------------------------------------------------------------------- OFF-5 hits


@case("OFF-5", "partial-hit", requires=["local_pools"])
def _partial_hit(ctx: CaseContext) -> None:
    """A longer prompt hits the stored prefix only, computes and stores the rest; a third request hits it all."""
    for f in (1, 2):
        scenario = OffloadScenario(
            config=FULL_SW,
            blocks_per_chunk=f,
            requests=[
                OffloadRequest(request_id="w", num_tokens=24),
                OffloadRequest(request_id="longer", num_tokens=41, local_hit_tokens=8),
                OffloadRequest(request_id="all", num_tokens=41),
            ],
        )
        result = run_offload(ctx, scenario, rule="OFF-5")
        _expect_hits(ctx, result, {"longer": (16,), "all": (40 if f == 1 else 40 - 40 % (4 * f),)}, "OFF-5")


@case("OFF-5", "evicted-window-chunk", requires=["local_pools"])
def _evicted_window(ctx: CaseContext) -> None:
    """One evicted window chunk shortens the hit to the last window the present chunks cover; none loads from it.

    B = 4, W = 8, f = 1, window chunks {0, 1, 2, 4} of 6 present (the
    docs/spec/offload.md example): a 25-token request hits 12, not 24 or 20
    (M = 24 needs chunks 4 and 5, M = 20 needs 3 and 4). With window chunk 2
    gone too, a 17-token request hits 8. With the LRU manager full, a later
    store evicts the oldest chunks, and a request that needed them hits less.
    """
    scenario = OffloadScenario(
        config=FULL_SW,
        chunk_rows=14,
        requests=[
            OffloadRequest(request_id="w", num_tokens=24),
            OffloadRequest(request_id="evicted", num_tokens=25, evict_before=[(1, 3), (1, 5)]),
            OffloadRequest(request_id="deeper", num_tokens=17, evict_before=[(1, 2)]),
            OffloadRequest(request_id="lru", num_tokens=24, stream="other"),
            OffloadRequest(request_id="after-lru", num_tokens=25),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-5")
    _expect_hits(ctx, result, {"evicted": (12,), "deeper": (8,)}, "OFF-5")


@case("OFF-5", "hit-as-long-as-the-rule", level="SHOULD", requires=["local_pools"])
def _hit_as_long(ctx: CaseContext) -> None:
    """Every hit of the generated scenarios is exactly the rule's, not shorter (OFF-5 SHOULD)."""

    @ctx.hypothesis
    @given(scenario=_generated_scenarios())
    def check(scenario: OffloadScenario) -> None:
        result = run_offload(ctx, scenario, rule="OFF-5")
        if result.hits != result.expected_hits:
            raise ctx.fail(f"OFF-5: hits shorter than the rule's\n\n{result.summary()}")

    check()


# --------------------------------------------------------------------------- OFF-6 loads


# Full attention B = 12 and a window W = 16 with B = 16, f = 1: a hit that the full-attention group stops at
# M = 36 leaves the window's first needed token (21) inside block 1, off the window's chunk grid.
MIXED_SW = make_config(full(12), sw(16, 16), num_blocks=64)


@case("OFF-6", "window-start-off-block-boundary", requires=["local_pools"])
def _window_off_boundary(ctx: CaseContext) -> None:
    """A window whose first needed token is inside a block loads cdiv(W + B - 1, B) blocks, more than W / C_g (#48959).

    Full attention B = 12 with chunk 3 evicted stops the hit at M = 36; the
    window (W = 16, B = 16) then needs tokens 21-35, blocks 1 and 2: two
    blocks, where #48959's bound cdiv(W, C_g) * f allows one. Also with
    f = 2 on B = 4, W = 8, where the bound holds.
    """
    scenario = OffloadScenario(
        config=MIXED_SW,
        hash_block_size=4,
        requests=[
            OffloadRequest(request_id="w", num_tokens=64),
            OffloadRequest(request_id="r", num_tokens=48, evict_before=[(0, 3)]),
            OffloadRequest(request_id="r2", num_tokens=61, local_hit_tokens=48),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-6")
    _expect_hits(ctx, result, {"r": (36,)}, "OFF-6")
    for f, reader in ((2, 22), (1, 18)):
        scenario = OffloadScenario(
            config=FULL_SW,
            blocks_per_chunk=f,
            requests=[
                OffloadRequest(request_id="w", num_tokens=32),
                OffloadRequest(request_id="r", num_tokens=reader),
            ],
        )
        run_offload(ctx, scenario, rule="OFF-6")


@case("OFF-6", "blocks-before-the-window-left-alone", requires=["local_pools"])
def _left_alone(ctx: CaseContext) -> None:
    """Real blocks before the window's first needed block are not written by a load (OFF-6: nothing reads them)."""
    for f in (1, 2):
        scenario = OffloadScenario(
            config=FULL_SW,
            blocks_per_chunk=f,
            requests=[
                OffloadRequest(request_id="w", num_tokens=32),
                OffloadRequest(request_id="r", num_tokens=22, allocate_skipped=True),
                OffloadRequest(request_id="r2", num_tokens=30, local_hit_tokens=8, allocate_skipped=True),
            ],
        )
        run_offload(ctx, scenario, rule="OFF-6")


@case("OFF-6", "generated-store-evict-load", requires=["local_pools"])
def _generated(ctx: CaseContext) -> None:
    """Generated windows, f, prompt lengths, GPU hits and evictions: every load restores exactly its pages."""

    @ctx.hypothesis
    @given(scenario=_generated_scenarios())
    @example(scenario=_pinned(f=3, window=8, reader=25, local=0, evict=()))  # the OFF-4 example's reader
    @example(scenario=_pinned(f=8, window=14, reader=50, local=0, evict=()))  # W off the block grid (#48959 shape)
    @example(scenario=_pinned(f=3, window=8, reader=47, local=4, evict=((1, 2),)))
    def check(scenario: OffloadScenario) -> None:
        run_offload(ctx, scenario, rule="OFF-6")

    check()


# --------------------------------------------------------------------------- OFF-7 sub-blocks


def _residue_scenario(f: int) -> OffloadScenario:
    readers = []
    for local in (0, 4, 8, 12):
        for n in range(13, 13 + 4 * f, 2):
            readers.append(
                OffloadRequest(request_id=f"c{local}-n{n + local}", num_tokens=n + local, local_hit_tokens=local)
            )
    return OffloadScenario(
        config=FULL_SW,
        blocks_per_chunk=f,
        requests=[OffloadRequest(request_id="w", num_tokens=48), *readers],
    )


@case("OFF-7", "loads-at-every-residue", requires=["local_pools"])
def _every_residue(ctx: CaseContext) -> None:
    """f = 1 and f = 3: loads whose first block L takes every residue of L mod f, in both groups, all land.

    The skip is ``L % f``, never ``(-L) % f``: the two agree for f = 3 only
    when L is a multiple of 3, which is why #41445's tests (every load on a
    multiple of 3) passed with the wrong sign.
    """
    for f in (1, 3):
        scenario = _residue_scenario(f)
        residues = {
            (g, positions.start % f)
            for r in scenario.requests[1:]
            for g, positions in enumerate(
                expected_load_positions(FULL_SW, num_tokens=r.num_tokens - 1, local_hit_tokens=r.local_hit_tokens)
            )
            if positions
        }
        if residues != {(g, s) for g in (0, 1) for s in range(f)}:  # pragma: no cover - guards the scenario
            raise AssertionError(f"the residue scenario covers only {sorted(residues)}")
        run_offload(ctx, scenario, rule="OFF-7")


# --------------------------------------------------------------------------- OFF-9 admission


@case("OFF-9", "state-group-without-prefix-caching-refused", requires=["local_pools"])
def _mamba(ctx: CaseContext) -> None:
    """A state group in ``none`` cache mode is refused with UnsupportedHybridError by the hit and the load hooks.

    Without prefix caching no state is kept at a chunk end, so no hit can say
    which state it restores (decision 161 in decisions-offload.md). Nothing moves.
    """
    hooks = _hooks(ctx)
    config = make_config(full(4), mamba(4), num_blocks=16)
    offload = OffloadConfig(blocks_per_chunk=1, hash_block_size=4)
    calls: dict[str, Callable[[], object]] = {
        "get_offload_hit_tokens": lambda: hooks.get_offload_hit_tokens(
            config, [[True] * 4, [True] * 4], request_id="m", num_tokens=17, local_hit_tokens=0, offload=offload
        ),
        "get_load_set": lambda: hooks.get_load_set(
            config, [[1, 2, 3, 4], [5, 6, 7, 8]], request_id="m", num_tokens=16, local_hit_tokens=0, offload=offload
        ),
    }
    for name, call in calls.items():
        try:
            call()
        except UnsupportedHybridError:
            continue
        except KVSpecError as exc:
            raise ctx.fail(
                f"OFF-9: {name} on a none-mode state group: expected UnsupportedHybridError, got {exc!r}"
            ) from None
        raise ctx.fail(
            f"OFF-9: {name} admitted a state group in cache mode 'none' (no state is kept at a chunk end; "
            "only align-mode state groups are specified)"
        )


# Full attention and an align-mode Mamba-2 state group, B = 4, f = 1: state chunk k holds the state after 4(k + 1).
FULL_STATE = make_config(full(4), mamba(4, cache_mode="align"), num_blocks=96)


@case("OFF-5", "state-hit-ends-on-a-state-chunk", requires=["local_pools"])
def _state_hit(ctx: CaseContext) -> None:
    """A state group's hit ends where a present state chunk ends, never at N - 1 off its grid (vLLM #44599, #51094).

    A 16-token writer stores state chunks 0-3 (the states after 4, 8, 12 and
    16 tokens). A 16-token reader recomputes its last token, so M = 15 rounds
    down to 12: chunk 2. Loading chunk 3 would restore the state after 16
    tokens and apply token 15 twice. A 17-token reader hits 16. With state
    chunk 2 evicted, a 16-token reader hits 8 (state chunk 1), though every
    attention chunk is present.
    """
    scenario = OffloadScenario(
        config=FULL_STATE,
        requests=[
            OffloadRequest(request_id="w", num_tokens=16),
            OffloadRequest(request_id="n16", num_tokens=16),
            OffloadRequest(request_id="n17", num_tokens=17),
            OffloadRequest(request_id="evicted", num_tokens=16, evict_before=[(1, 2)]),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-5")
    _expect_hits(ctx, result, {"n16": (12,), "n17": (16,), "evicted": (8,)}, "OFF-5")


@case("OFF-6", "state-slot-restored-at-the-resume-point", requires=["local_pools"])
def _state_load(ctx: CaseContext) -> None:
    """A state load restores one slot, the one at T / B - 1, and says its state absorbed t = T tokens (STATE-1).

    After a GPU prefix hit of 4 tokens, a 16-token reader hits 8 (T = 12):
    the state group restores only position 2 from state chunk 2, and the
    load set's ``state_tokens`` is 12. The earlier slots are null, as vLLM
    nulls the slots of earlier states; the attention group restores 1-2.
    """
    scenario = OffloadScenario(
        config=FULL_STATE,
        requests=[
            OffloadRequest(request_id="w", num_tokens=24),
            OffloadRequest(request_id="r", num_tokens=16, local_hit_tokens=4),
            OffloadRequest(request_id="longer", num_tokens=29, local_hit_tokens=8),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-6")
    _expect_hits(ctx, result, {"r": (8,), "longer": (16,)}, "OFF-6")


# Three align-mode state groups before full attention (Qwen3-Next's order), and with a window of 8 after them.
SEVERAL_STATES = make_config(*[mamba(4, cache_mode="align")] * 3, full(4), num_blocks=160)
SEVERAL_STATES_SW = make_config(*[mamba(4, cache_mode="align")] * 3, full(4), sw(8, 4), num_blocks=192)


@case("OFF-5", "several-state-groups-hit-every-group", requires=["local_pools"])
def _several_state_hits(ctx: CaseContext) -> None:
    """With three state groups the hit ends where every state group's chunk is present, not only the first's.

    A 16-token writer stores state chunks 0-3 of each group. A 16-token
    reader hits 12 (state chunk 2 of every group). With the third state
    group's chunk 2 and the second group's chunk 1 evicted it hits 4: 12
    needs the third group's chunk 2, 8 the second's chunk 1. The first state
    group still holds every chunk, so a hit read from it alone restores
    states the other groups do not have.
    """
    scenario = OffloadScenario(
        config=SEVERAL_STATES,
        requests=[
            OffloadRequest(request_id="w", num_tokens=16),
            OffloadRequest(request_id="n16", num_tokens=16),
            OffloadRequest(request_id="evicted", num_tokens=16, evict_before=[(2, 2), (1, 1)]),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-5")
    _expect_hits(ctx, result, {"n16": (12,), "evicted": (4,)}, "OFF-5")


@case("OFF-6", "several-state-groups-restored", requires=["local_pools"])
def _several_state_loads(ctx: CaseContext) -> None:
    """Each of three state groups restores its own slot at T / B - 1, beside full attention and a window of 8.

    A 24-token writer stores; a 16-token reader with a 4-token GPU hit hits 8
    (T = 12) and restores position 2 of every state group from its chunk 2;
    a 29-token reader with an 8-token GPU hit restores position 5 (T = 24).
    A load that restores only the first state group leaves the others'
    slots stale (STATE-1, OFF-6).
    """
    scenario = OffloadScenario(
        config=SEVERAL_STATES_SW,
        requests=[
            OffloadRequest(request_id="w", num_tokens=24),
            OffloadRequest(request_id="r", num_tokens=16, local_hit_tokens=4),
            OffloadRequest(request_id="longer", num_tokens=29, local_hit_tokens=8),
        ],
    )
    result = run_offload(ctx, scenario, rule="OFF-6")
    _expect_hits(ctx, result, {"r": (8,), "longer": (16,)}, "OFF-6")


# --------------------------------------------------------------------------- generated scenarios


def _pinned(*, f: int, window: int, reader: int, local: int, evict: tuple[tuple[int, int], ...]) -> OffloadScenario:
    config = make_config(full(4), sw(window, 4), num_blocks=160, layers=1)
    return OffloadScenario(
        config=config,
        blocks_per_chunk=f,
        requests=[
            OffloadRequest(request_id="w", num_tokens=40, local_hit_tokens=0, decode_tokens=20),
            OffloadRequest(request_id="r", num_tokens=reader, local_hit_tokens=local, evict_before=evict),
        ],
    )


@st.composite
def _generated_scenarios(draw: st.DrawFn) -> OffloadScenario:
    second = draw(st.sampled_from([4, 4, 8, 12]))  # the window group's block size; f = 1 when it differs (OFF-1)
    f = draw(st.sampled_from([1, 2, 3, 4])) if second == 4 else 1
    window = draw(st.integers(1, 24))
    writer = draw(st.integers(1, 64))
    reader = draw(st.integers(1, 72))
    unit = math.lcm(4, second)  # a GPU hit is a multiple of every block size
    local = unit * draw(st.integers(0, reader // unit))
    chunks = (writer + 4 * f - 1) // (4 * f)
    evict = draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, max(0, chunks - 1))), max_size=3, unique=True))
    writer_hit = unit * draw(st.integers(0, writer // unit))
    return OffloadScenario(
        config=make_config(full(4), sw(window, second), num_blocks=160, layers=1),
        blocks_per_chunk=f,
        hash_block_size=4,
        requests=[
            OffloadRequest(request_id="w", num_tokens=writer, local_hit_tokens=writer_hit, decode_tokens=8),
            OffloadRequest(request_id="r", num_tokens=reader, local_hit_tokens=local, evict_before=evict),
            OffloadRequest(request_id="r2", num_tokens=reader + 5),
        ],
    )
