"""Cases on where bytes land: clipping, alignment, null blocks, window coverage, layout, presets, generated."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvspec import (
    BlockAlignmentError,
    FailureReason,
    TransferMode,
    UnsupportedHybridError,
    WindowCoverageError,
    check_hybrid_support,
)
from kvspec.presets import list_presets
from kvspec.spec.state import check_state_prefix_hit

from .._cases import case
from .._context import CaseContext
from .._scenario import PresetConfig, Request, Scenario
from ..configs import full, make_config, mla, sw, sw_mla
from ..strategies import scenarios

__all__: list[str] = []

# Full attention B=4 and sliding window W=8, B=4: budget cdiv(8, 4) + 1 = 3 blocks (SW-1).
FA_SW = make_config(full(4), sw(8, 4), num_blocks=40)


def _modes(ctx: CaseContext) -> list[str]:
    return [m.value for m in (TransferMode.READ, TransferMode.WRITE) if m in ctx.capabilities.modes]


def _all_loaded(ctx: CaseContext, scenario: Scenario, rule: str) -> None:
    for mode in _modes(ctx):
        played = Scenario(
            config=scenario.config,
            consumer_config=scenario.consumer_config,
            requests=scenario.requests,
            mode=mode,
        )
        result = ctx.run(played)
        ctx.expect(result, loaded=[r.request_id for r in scenario.requests], rule=rule)


# --------------------------------------------------------------------------- SW-1


@case("SW-1", "budget-covers-misaligned-window")
def _sw_budget(ctx: CaseContext) -> None:
    """A window that does not start on a block boundary needs cdiv(W, B) + 1 blocks, and all of them land."""
    # T=10, W=8, B=4: positions [3, 9] span blocks 0, 1 and 2: three blocks, exactly the budget.
    _all_loaded(ctx, Scenario(config=FA_SW, requests=[Request(request_id="t10", num_tokens=10)]), "SW-1")


@case("SW-1", "pinned-window-sizes")
def _sw_pinned(ctx: CaseContext) -> None:
    """Windows 32, 128 and 2048 at B=16 move at most the pinned 3, 9 and 129 blocks, and every needed one."""
    config = make_config(full(16), sw(32, 16), sw(128, 16), num_blocks=96, layers=1)
    requests = [Request(request_id=f"t{t}", num_tokens=t) for t in (33, 47, 129, 143)]
    _all_loaded(ctx, Scenario(config=config, requests=requests), "SW-1")
    big = make_config(full(16), sw(2048, 16), num_blocks=300, layers=1)
    _all_loaded(ctx, Scenario(config=big, requests=[Request(request_id="t2080", num_tokens=2080)]), "SW-1")


@case("SW-1", "per-group-block-size")
def _sw_block_sizes(ctx: CaseContext) -> None:
    """Each sliding-window group's budget uses its own block size."""
    config = make_config(full(8), sw(8, 4), sw(8, 2), num_blocks=64)
    requests = [Request(request_id=f"t{t}", num_tokens=t) for t in (9, 15, 16, 23)]
    _all_loaded(ctx, Scenario(config=config, requests=requests), "SW-1")


# --------------------------------------------------------------------------- CLIP-1


@case("CLIP-1", "sw-tail-keeps-last-n")
def _clip_tail(ctx: CaseContext) -> None:
    """Lists longer than the budget keep their last n ids: blocks before the window never move."""
    # Both sides hold real blocks for every position (no pruning): only the last 3 SW pairs may move.
    producer = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    consumer = [[13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]]
    scenario = Scenario(
        config=FA_SW,
        requests=[Request(request_id="r", num_tokens=22, producer_block_ids=producer, consumer_block_ids=consumer)],
    )
    _all_loaded(ctx, scenario, "CLIP-1")


@case("CLIP-1", "shorter-than-budget-kept-whole")
def _clip_short(ctx: CaseContext) -> None:
    """A list shorter than its budget is kept whole (never padded, never Python's x[-0:])."""
    requests = [Request(request_id=f"t{t}", num_tokens=t) for t in (1, 3, 4, 5, 8)]
    _all_loaded(ctx, Scenario(config=FA_SW, requests=requests), "CLIP-1")


@case("CLIP-1", "full-prefix-hit-zero-groups")
def _clip_full_hit(ctx: CaseContext) -> None:
    """A full prefix hit offers zero groups: nothing moves, the request still completes and releases."""
    requests = [
        Request(request_id="hit", num_tokens=16, prefix_hit_tokens=16),
        Request(request_id="miss", num_tokens=16),
    ]
    _all_loaded(ctx, Scenario(config=FA_SW, requests=requests), "CLIP-1")


@case("CLIP-1", "full-attention-groups-unclipped")
def _clip_full_groups(ctx: CaseContext) -> None:
    """Full-attention and MLA groups are never clipped: every block of a long prompt lands."""
    config = make_config(full(4), mla(4), sw(4, 4), num_blocks=64)
    _all_loaded(ctx, Scenario(config=config, requests=[Request(request_id="long", num_tokens=57)]), "CLIP-1")


# --------------------------------------------------------------------------- ALIGN-1


@case("ALIGN-1", "prefix-hit-every-length")
def _align_every_hit(ctx: CaseContext) -> None:
    """Prefix hits of every length (none, partial, full) pair C's suffix with P's tail, never its front."""
    requests = [Request(request_id=f"h{h}", num_tokens=22, prefix_hit_tokens=h) for h in range(0, 24, 4) if h <= 22]
    requests.append(Request(request_id="h-full", num_tokens=20, prefix_hit_tokens=20))
    config = make_config(full(4), sw(8, 4), num_blocks=96)
    _all_loaded(ctx, Scenario(config=config, requests=requests), "ALIGN-1")


@case("ALIGN-1", "consumer-longer-than-producer-fails", level="MUST")
def _align_too_long(ctx: CaseContext) -> None:
    """A consumer holding more blocks than the producer offers fails before any byte moves."""
    scenario = Scenario(
        config=FA_SW,
        requests=[
            Request(
                request_id="bad", num_tokens=8, producer_block_ids=[[1, 2], [3, 4]], consumer_block_ids=[[5, 6, 7], [8]]
            ),
            Request(request_id="good", num_tokens=9),
        ],
    )
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=FA_SW, requests=scenario.requests, mode=mode))
        ctx.expect(result, loaded=["good"], failed={"bad": None}, errors={"bad": BlockAlignmentError}, rule="ALIGN-1")


@case("ALIGN-1", "write-partial-prefix-hit", requires=["write"])
def _align_write_hit(ctx: CaseContext) -> None:
    """WRITE with a partial prefix hit on the consumer pushes into the suffix by tail alignment (vLLM B5)."""
    requests = [Request(request_id=f"h{h}", num_tokens=30, prefix_hit_tokens=h) for h in (4, 12, 24)]
    result = ctx.run(Scenario(config=make_config(full(4), sw(8, 4), num_blocks=64), requests=requests, mode="write"))
    ctx.expect(result, loaded=[r.request_id for r in requests], rule="ALIGN-1")


# --------------------------------------------------------------------------- NULL-1


@case("NULL-1", "pruned-producer-nulls-dropped")
def _null_pruned(ctx: CaseContext) -> None:
    """Producer null ids (pruned out-of-window blocks) pair with nothing; the null block never moves."""
    # P pruned the first SW blocks (vLLM B7); C offers real blocks there after its own clipping.
    scenario = Scenario(
        config=FA_SW,
        requests=[
            Request(
                request_id="r",
                num_tokens=16,
                producer_block_ids=[[1, 2, 3, 4], [0, 5, 6, 7]],
                consumer_block_ids=[[8, 9, 10, 11], [12, 13, 14]],
            )
        ],
    )
    _all_loaded(ctx, scenario, "NULL-1")


@case("NULL-1", "consumer-null-entries-dropped")
def _null_consumer(ctx: CaseContext) -> None:
    """Consumer null ids (skipped positions it allocated as null) are dropped, not written to block 0."""
    scenario = Scenario(
        config=FA_SW,
        requests=[
            Request(
                request_id="r",
                num_tokens=16,
                producer_block_ids=[[1, 2, 3, 4], [5, 6, 7, 8]],
                consumer_block_ids=[[9, 10, 11, 12], [0, 13, 14]],
            )
        ],
    )
    _all_loaded(ctx, scenario, "NULL-1")


# --------------------------------------------------------------------------- WIN-1


def _window_boundary(ctx: CaseContext, offset: int, rule_slug: str) -> None:
    # (T - W + offset) % B == 0 for several T, each with and without a prefix hit.
    window, block = 8, 4
    requests = []
    for t in range(window, 4 * window):
        if (t - window + offset) % block == 0:
            requests.append(Request(request_id=f"t{t}", num_tokens=t))
            requests.append(Request(request_id=f"t{t}-h4", num_tokens=t, prefix_hit_tokens=4))
    config = make_config(full(block), sw(window, block), num_blocks=160)
    _all_loaded(ctx, Scenario(config=config, requests=requests), rule_slug)


@case("WIN-1", "window-start-on-block-boundary")
def _win_boundary_1(ctx: CaseContext) -> None:
    """(T - W + 1) % B == 0: the window starts exactly on a block; the block before it never moves."""
    _window_boundary(ctx, 1, "WIN-1")


@case("WIN-1", "window-start-one-past-boundary")
def _win_boundary_2(ctx: CaseContext) -> None:
    """(T - W + 2) % B == 0: the window starts on the last position of a block, which must land (vLLM H2)."""
    _window_boundary(ctx, 2, "WIN-1")


@case("WIN-1", "token-sweep-around-boundaries")
def _win_sweep(ctx: CaseContext) -> None:
    """T = 1, W - 1, W, W + 1 and B +/- 1 around several blocks: every needed block lands, nothing else."""
    window, block = 8, 4
    counts = sorted({1, block - 1, block, block + 1, window - 1, window, window + 1, 2 * window + 1, 3 * block - 1})
    requests = [Request(request_id=f"t{t}", num_tokens=t) for t in counts]
    _all_loaded(
        ctx, Scenario(config=make_config(full(block), sw(window, block), num_blocks=96), requests=requests), "WIN-1"
    )


@case("WIN-1", "needed-block-null-on-producer-fails")
def _win_null_needed(ctx: CaseContext) -> None:
    """A producer that pruned a block the window still needs (vLLM H2) fails before any byte moves."""
    # T=14, W=8: needed SW positions [7, 13] -> blocks 1..3; P nulled block 1.
    bad = Request(
        request_id="h2",
        num_tokens=14,
        producer_block_ids=[[1, 2, 3, 4], [0, 0, 5, 6]],
        consumer_block_ids=[[7, 8, 9, 10], [11, 12, 13]],
    )
    good = Request(request_id="ok", num_tokens=14)
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=FA_SW, requests=[bad, good], mode=mode))
        ctx.expect(
            result,
            loaded=["ok"],
            failed={"h2": FailureReason.WINDOW_COVERAGE},
            errors={"h2": WindowCoverageError},
            rule="WIN-1",
        )


@case("WIN-1", "needed-block-missing-on-consumer-fails")
def _win_consumer_missing(ctx: CaseContext) -> None:
    """A consumer offering null where a needed position lies fails before any byte moves."""
    bad = Request(
        request_id="gap",
        num_tokens=14,
        producer_block_ids=[[1, 2, 3, 4], [0, 5, 6, 7]],
        consumer_block_ids=[[8, 9, 10, 11], [0, 12, 13]],
    )
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=FA_SW, requests=[bad], mode=mode))
        ctx.expect(
            result, failed={"gap": FailureReason.WINDOW_COVERAGE}, errors={"gap": WindowCoverageError}, rule="WIN-1"
        )


@case("WIN-1", "empty-group-list-fails")
def _win_empty_group(ctx: CaseContext) -> None:
    """An empty list for a group that still needs blocks fails before any byte moves, on either side."""
    requests = [
        Request(
            request_id="p-empty",
            num_tokens=10,
            producer_block_ids=[[1, 2, 3], []],
            consumer_block_ids=[[4, 5, 6], [7, 8]],
        ),
        Request(
            request_id="c-empty",
            num_tokens=10,
            producer_block_ids=[[9, 10, 11], [12, 13]],
            consumer_block_ids=[[14, 15, 16], []],
        ),
        Request(request_id="ok", num_tokens=10),
    ]
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=FA_SW, requests=requests, mode=mode))
        ctx.expect(
            result,
            loaded=["ok"],
            failed={"p-empty": FailureReason.WINDOW_COVERAGE, "c-empty": FailureReason.WINDOW_COVERAGE},
            errors={"p-empty": WindowCoverageError, "c-empty": WindowCoverageError},
            rule="WIN-1",
        )


# --------------------------------------------------------------------------- TOK-1


@case("TOK-1", "explicit-count-sw-group-first")
def _tok_explicit(ctx: CaseContext) -> None:
    """With the sliding-window group first (Gemma 3 order) and T mid-block, positions follow the explicit T."""
    config = make_config(sw(8, 4), full(4), num_blocks=96)
    requests = [Request(request_id=f"t{t}", num_tokens=t, prefix_hit_tokens=h) for t, h in ((13, 0), (37, 8), (38, 36))]
    _all_loaded(ctx, Scenario(config=config, requests=requests), "TOK-1")


@case("TOK-1", "sliding-window-only-model")
def _tok_sw_only(ctx: CaseContext) -> None:
    """A model with no full-attention group (no token basis) still transfers by the explicit count."""
    config = make_config(sw(8, 4), sw_mla(12, 4), num_blocks=64)
    requests = [Request(request_id=f"t{t}", num_tokens=t) for t in (5, 17, 30)]
    _all_loaded(ctx, Scenario(config=config, requests=requests), "TOK-1")


# --------------------------------------------------------------------------- HMA-1, ADM-1, ADM-2


@case("HMA-1", "sliding-only-model-is-hybrid")
def _hma_sw_only(ctx: CaseContext) -> None:
    """A model whose only group is sliding window is hybrid: its blocks are clipped to the window."""
    config = make_config(sw(8, 4), num_blocks=48)
    producer = [[1, 2, 3, 4, 5, 6, 7]]
    consumer = [[8, 9, 10, 11, 12, 13, 14]]
    request = Request(request_id="r", num_tokens=27, producer_block_ids=producer, consumer_block_ids=consumer)
    _all_loaded(ctx, Scenario(config=config, requests=[request]), "HMA-1")


@case("HMA-1", "mla-counts-as-full-attention")
def _hma_mla(ctx: CaseContext) -> None:
    """MLA groups are full attention: never clipped, every block lands."""
    config = make_config(mla(4), sw_mla(8, 4), num_blocks=48)
    _all_loaded(ctx, Scenario(config=config, requests=[Request(request_id="r", num_tokens=30)]), "HMA-1")


@case("ADM-1", "unsupported-kinds-refused-before-setup")
def _adm_refused(ctx: CaseContext) -> None:
    """Cross-attention groups and state kinds outside mamba1/mamba2/GDN/KDA are refused before any agent exists.

    Chunked local attention, refused here before CACHE-1, is admitted now: its
    window stops at a chunk boundary (CACHE-1/chunk-boundaries).
    """
    from ..configs import cross, mamba

    unknown_state = make_config(full(4), mamba(4, mamba_type="short_conv"))
    for config in (make_config(full(4), cross(4)), unknown_state):
        for mode in _modes(ctx):
            result = ctx.run(Scenario(config=config, mode=mode, requests=[Request(request_id="r", num_tokens=9)]))
            if not isinstance(result.refused, UnsupportedHybridError):
                raise ctx.fail(f"ADM-1: expected UnsupportedHybridError before setup, got {result.summary()}")


@case("ADM-2", "both-modes-under-hma")
def _adm_both_modes(ctx: CaseContext) -> None:
    """READ and WRITE both move a hybrid model's blocks correctly (each mode the backend declares)."""
    check_hybrid_support(FA_SW, mode=TransferMode.READ)
    requests = [Request(request_id=f"t{t}", num_tokens=t, prefix_hit_tokens=h) for t, h in ((11, 0), (26, 8))]
    _all_loaded(ctx, Scenario(config=FA_SW, requests=requests), "ADM-2")


# --------------------------------------------------------------------------- PLAN-1


@case("PLAN-1", "two-groups-share-a-tensor")
def _plan_shared(ctx: CaseContext) -> None:
    """Layers of different groups sharing one tensor (vLLM's hybrid layout) each land in their own pages."""
    config = make_config(full(4), sw(8, 4), num_blocks=64, layout="shared")
    requests = [Request(request_id=f"t{t}", num_tokens=t, prefix_hit_tokens=h) for t, h in ((10, 0), (21, 4), (33, 8))]
    _all_loaded(ctx, Scenario(config=config, requests=requests), "PLAN-1")


@case("PLAN-1", "every-layout")
def _plan_layouts(ctx: CaseContext) -> None:
    """Block-major, layer-major, per-layer and shared tensors all move exactly the paired pages."""
    for layout in ("separate", "layers_first", "per_layer", "shared"):
        config = make_config(full(4), sw(8, 4), num_blocks=48, layers=3, layout=layout)
        _all_loaded(ctx, Scenario(config=config, requests=[Request(request_id="r", num_tokens=19)]), "PLAN-1")


@case("PLAN-1", "groups-with-different-block-sizes")
def _plan_block_sizes(ctx: CaseContext) -> None:
    """Groups with different block sizes and page sizes land per group."""
    config = make_config(full(8), sw(8, 4), full(2), num_blocks=96, layers=[1, 2, 1])
    requests = [Request(request_id=f"t{t}", num_tokens=t, prefix_hit_tokens=h) for t, h in ((9, 0), (25, 8), (40, 16))]
    _all_loaded(ctx, Scenario(config=config, requests=requests), "PLAN-1")


@case("PLAN-1", "different-consumer-layout")
def _plan_consumer_layout(ctx: CaseContext) -> None:
    """The consumer's tensors may be laid out differently (and hold more blocks) than the producer's."""
    producer = make_config(full(4), sw(8, 4), num_blocks=40)
    consumer = make_config(full(4), sw(8, 4), num_blocks=56, layout="per_layer")
    for mode in _modes(ctx):
        scenario = Scenario(
            config=producer,
            consumer_config=consumer,
            mode=mode,
            requests=[Request(request_id="r", num_tokens=23, prefix_hit_tokens=4)],
        )
        ctx.expect(ctx.run(scenario), loaded=["r"], rule="PLAN-1")


@case("PLAN-1", "many-concurrent-requests-interleaved")
def _plan_concurrent(ctx: CaseContext) -> None:
    """Many requests in flight at once on one pair of agents: each lands in its own blocks only."""
    requests = [Request(request_id=f"r{i}", num_tokens=5 + 3 * i, prefix_hit_tokens=4 * (i % 3)) for i in range(24)]
    requests += [Request(request_id=f"w{i}", num_tokens=9 + i, wave=1) for i in range(8)]
    config = make_config(full(4), sw(8, 4), num_blocks=512, layers=1)
    _all_loaded(ctx, Scenario(config=config, requests=requests), "PLAN-1")


@case("PLAN-1", "every-model-preset")
def _plan_presets(ctx: CaseContext) -> None:
    """Every admitted model preset (few layers, small pages) moves its blocks correctly; others are refused."""
    for preset in list_presets():
        # The divisor shrinks state tensors as it shrinks heads, so a state hybrid's padded page stays small.
        config = PresetConfig(name=preset.alias, num_blocks=192, max_layers_per_group=1, head_size_divisor=32)
        try:
            check_hybrid_support(config.build(), mode=TransferMode.READ)
        except Exception:
            result = ctx.run(Scenario(config=config, requests=[Request(request_id="r", num_tokens=40)]))
            if result.refused is None:
                raise ctx.fail(f"PLAN-1: preset {preset.alias} must be refused at admission (ADM-1)") from None
            continue
        requests = [Request(request_id="r", num_tokens=100)]
        try:
            # A state group in cache mode 'none' caches no state for a prefix: no hit to ask for (STATE-4).
            check_state_prefix_hit(config.build(), prefix_hit_tokens=64)
            requests.append(Request(request_id="hit", num_tokens=100, prefix_hit_tokens=64))
        except BlockAlignmentError:
            pass
        _all_loaded(ctx, Scenario(config=config, requests=requests), "PLAN-1")


@case("PLAN-1", "out-of-range-descriptor-refused", requires=["local_pools"])
def _plan_bounds(ctx: CaseContext) -> None:
    """A descriptor outside the registered regions is refused at post, before any byte moves."""
    from kvspec import PlanError, TransportError
    from kvspec.testing import allocate_pool, fill_background
    from kvspec.transport import Descriptor

    config = make_config(full(4), num_blocks=8)
    backend = ctx.backend
    with allocate_pool(config) as p_pool, allocate_pool(config) as c_pool:
        fill_background(p_pool, seed="p")
        fill_background(c_pool, seed="c")
        before = c_pool.snapshot()
        producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
        try:
            producer.register_memory(p_pool.regions)
            consumer.register_memory(c_pool.regions)
            peer = consumer.add_remote_agent(producer.get_agent_metadata())
            producer.add_remote_agent(consumer.get_agent_metadata())
            size = config.kv_cache_tensors[0].size
            bad = [
                Descriptor(local_region=0, local_offset=size - 4, remote_region=0, remote_offset=0, nbytes=8),
                Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=size, nbytes=1),
                Descriptor(local_region=5, local_offset=0, remote_region=0, remote_offset=0, nbytes=1),
            ]
            good = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=4)
            for descriptor in bad:
                try:
                    handle = consumer.post(TransferMode.READ, [good, descriptor], peer=peer)
                except (PlanError, TransportError):
                    continue
                consumer.release(handle)
                raise ctx.fail(f"PLAN-1: post accepted an out-of-range descriptor {descriptor!r}")
            for _ in range(5):
                consumer.get_notifications()
                producer.get_notifications()
            if c_pool.snapshot() != before:
                raise ctx.fail("PLAN-1: a refused post changed the consumer's memory")
        finally:
            consumer.close()
            producer.close()


# --------------------------------------------------------------------------- generated


@case("PLAN-1", "generated-configs-and-requests")
def _generated(ctx: CaseContext) -> None:
    """Generated configs (kinds, block sizes, windows, layouts) and requests (lengths, prefix hits) all land."""

    @ctx.hypothesis
    @given(scenarios(modes=tuple(_modes(ctx))))
    def check(scenario: Scenario) -> None:
        result = ctx.run(scenario)
        ctx.expect(result, loaded=[r.request_id for r in scenario.requests], rule="PLAN-1")

    check()


@case("WIN-1", "generated-boundaries")
def _generated_win(ctx: CaseContext) -> None:
    """Generated windows and token counts near (T - W + 1) and block boundaries: needed blocks land, others do not."""

    @ctx.hypothesis
    @given(
        window=st.integers(1, 24),
        block=st.sampled_from([1, 2, 4, 8]),
        offset=st.integers(-2, 3),
        hit_blocks=st.integers(0, 3),
        mode=st.sampled_from(_modes(ctx)),
    )
    def check(window: int, block: int, offset: int, hit_blocks: int, mode: str) -> None:
        t = max(1, window + offset + block * hit_blocks)
        hit = min(hit_blocks * block, (t // block) * block)
        config = make_config(full(block), sw(window, block), num_blocks=2 * (t // block + 3) + 8, layers=1)
        scenario = Scenario(
            config=config,
            mode=mode,
            requests=[Request(request_id="r", num_tokens=t, prefix_hit_tokens=hit)],
        )
        ctx.expect(ctx.run(scenario), loaded=["r"], rule="WIN-1")

    check()
