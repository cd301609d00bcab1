"""Many ranks to many: TP, PP and DCP exchanges, one agent and one pool per rank, checked against the canonical page.

Every case plays one request with :func:`run_par_scenario`: the producer
ranks' pages are projections of keyed canonical content, kvspec's planner
pairs every (producer rank, consumer rank), the backend under test moves the
bytes between one agent per rank, and the oracle checks every consumer rank's
pages against the projection of the canonical content onto what it owns,
every other byte unchanged, each consumer byte written once and each producer
rank freed after exactly the notifications the mapping implies
(docs/spec/parallelism.md, "What the suite checks"). Pages are tiny: a few
heads of 2 bytes, blocks of 2 or 4 tokens, 2 blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec import ParallelismError, TransferMode
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, SubBlock

from .._cases import case
from .._context import CaseContext
from .._parallel_scenario import ParLayer, ParScenario, run_par_scenario

__all__ = ["attention_page", "gdn_page", "kda_page", "mamba2_page", "mla_page", "play"]

_SIZES = (1, 2, 4, 8)
_PAIRS = [(p, d) for p in _SIZES for d in _SIZES if p != d]


# --------------------------------------------------------------------------- pages


def attention_page(heads: int, *, block_size: int = 2, order: PageOrder = PageOrder.HND) -> CanonicalPage:
    """K then V, ``heads`` KV heads of 2 bytes over the block's tokens (vLLM HND, SGLang NHD)."""
    kv = [SubBlock(name="kv_heads", extent=heads)]
    return CanonicalPage(
        tensors=[
            PageTensor(name=n, sub_blocks=kv, rows=block_size, element_bytes=2, order=order, token_rows=True)
            for n in ("k", "v")
        ]
    )


def mla_page(*, block_size: int = 2, order: PageOrder = PageOrder.HND) -> CanonicalPage:
    """One latent of 4 bytes per token, replicated on every rank."""
    latent = SubBlock(name="latent", extent=1, replicated=True)
    tensor = PageTensor(
        name="latent", sub_blocks=[latent], rows=block_size, element_bytes=4, order=order, token_rows=True
    )
    return CanonicalPage(tensors=[tensor])


def _state_page(conv: Sequence[SubBlock], heads: int, head_bytes: int) -> CanonicalPage:
    # Conv state (channels, kernel - 1) in DS layout, int8; the SSM / recurrent state split by heads.
    return CanonicalPage(
        tensors=[
            PageTensor(name="conv", sub_blocks=conv, rows=2, element_bytes=1),
            PageTensor(name="ssm", sub_blocks=[SubBlock(name="heads", extent=heads)], rows=1, element_bytes=head_bytes),
        ]
    )


def mamba2_page(n_groups: int, *, heads: int = 4) -> CanonicalPage:
    """Mamba-2: conv over x (heads * head_dim), B and C (n_groups * d_state each); SSM (heads, head_dim, d_state)."""
    x = SubBlock(name="x", extent=heads, width=2)
    b, c = (SubBlock(name=n, extent=n_groups, width=2) for n in ("B", "C"))
    return _state_page([x, b, c], heads, 4)


def gdn_page(*, k_heads: int = 2, v_heads: int = 4) -> CanonicalPage:
    """Gated DeltaNet: conv over Q, K (k_heads) and V (v_heads), each 2 wide; recurrent state per V head."""
    q, k = (SubBlock(name=n, extent=k_heads, width=2) for n in ("q", "k"))
    return _state_page([q, k, SubBlock(name="v", extent=v_heads, width=2)], v_heads, 4)


def kda_page(*, heads: int = 4) -> CanonicalPage:
    """Kimi Delta Attention: conv over Q, K, V (heads each); float32 recurrent state (head_dim^2) per head."""
    return _state_page([SubBlock(name=n, extent=heads, width=2) for n in ("q", "k", "v")], heads, 16)


# --------------------------------------------------------------------------- running


def _layers(*pages: tuple[str, CanonicalPage]) -> tuple[ParLayer, ...]:
    return tuple(ParLayer(name=name, page=page) for name, page in pages)


def _mode(ctx: CaseContext, mode: TransferMode) -> None:
    if mode not in ctx.capabilities.modes:
        raise ctx.skip(f"the backend does not support {mode.value.upper()}")


def play(ctx: CaseContext, scenario: ParScenario, *, rule: str) -> None:
    """Run ``scenario`` on the backend under test; fail with the oracle's findings and a reproducer."""
    _mode(ctx, scenario.mode)
    ctx.last_reproducer = (
        "from kvspec_conformance._parallel_scenario import *\n"
        "from kvspec_conformance.cases.parallel import *\n"
        "from kvspec.transport import load_backend\n"
        f"print(run_par_scenario({scenario!r}, backend=load_backend({ctx.backend_spec!r})))"
    )
    result = run_par_scenario(scenario, backend=ctx.backend)
    if result.refused is not None:
        raise ctx.fail(f"{rule}: planning refused a layout the rules admit: {result.refused}")
    if result.problems:
        shown = list(result.problems[:12])
        more = len(result.problems) - len(shown)
        raise ctx.fail(f"{rule}: " + "\n".join(shown + ([f"... and {more} more"] if more else [])))


def _scenario(layers: tuple[ParLayer, ...], producer_tp: int, consumer_tp: int, **kw: object) -> ParScenario:
    deadline = 10.0
    return ParScenario(layers=layers, producer_tp=producer_tp, consumer_tp=consumer_tp, deadline=deadline, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- PAR-1 ownership: TP pairs


def _register_tp_pair(producer_tp: int, consumer_tp: int) -> None:
    mode = TransferMode.READ if producer_tp < consumer_tp else TransferMode.WRITE

    def run(ctx: CaseContext) -> None:
        layers = _layers(("l0", attention_page(8)), ("l1", attention_page(8)))
        play(ctx, _scenario(layers, producer_tp, consumer_tp, mode=mode), rule="PAR-1")

    run.__doc__ = (
        f"TP{producer_tp} to TP{consumer_tp}, 8 KV heads, {mode.value.upper()}: each consumer rank holds its "
        "heads' share of the canonical page"
    )
    case("PAR-1", f"tp-{producer_tp}-to-{consumer_tp}", requires=[mode.value, "notifications", "local_pools"])(run)


for _p, _d in _PAIRS:
    _register_tp_pair(_p, _d)


@case("PAR-1", "kv-heads-fewer-than-tp", requires=["read", "notifications", "local_pools"])
def kv_heads_fewer_than_tp(ctx: CaseContext) -> None:
    """TP1 to TP4 with 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1, never all head 0 (SGLang #23746)."""
    play(ctx, _scenario(_layers(("l0", attention_page(2))), 1, 4), rule="PAR-1")


# --------------------------------------------------------------------------- PAR-2 the page is a projection


@case("PAR-2", "nhd-page-tp-2-to-4", requires=["read", "notifications", "local_pools"])
def nhd_page(ctx: CaseContext) -> None:
    """TP2 to TP4 with NHD pages (SGLang): a rank's heads are one run per token, not one run per head."""
    layers = _layers(("l0", attention_page(4, block_size=4, order=PageOrder.NHD)))
    play(ctx, _scenario(layers, 2, 4), rule="PAR-2")


@case("PAR-2", "nhd-page-tp-4-to-1-write", requires=["write", "notifications", "local_pools"])
def nhd_page_write(ctx: CaseContext) -> None:
    """TP4 to TP1, NHD, WRITE: four producer ranks each write their heads' run into every token row."""
    layers = _layers(("l0", attention_page(4, block_size=4, order=PageOrder.NHD)))
    play(ctx, _scenario(layers, 4, 1, mode=TransferMode.WRITE), rule="PAR-2")


# --------------------------------------------------------------------------- PAR-3 coverage of sub-blocks


@case("PAR-3", "mamba2-n-groups-1", requires=["read", "notifications", "local_pools"])
def mamba2_n_groups_1(ctx: CaseContext) -> None:
    """Mamba-2, n_groups=1, TP1 to TP2: B and C whole on both ranks, x and SSM heads split (vLLM #55208)."""
    play(ctx, _scenario(_layers(("m0", mamba2_page(1))), 1, 2), rule="PAR-3")


@case("PAR-3", "mamba2-n-groups-tp", requires=["write", "notifications", "local_pools"])
def mamba2_n_groups_tp(ctx: CaseContext) -> None:
    """Mamba-2, n_groups=4, TP1 to TP4, WRITE: x, B and C each split four ways, not the conv dim as one."""
    play(ctx, _scenario(_layers(("m0", mamba2_page(4))), 1, 4, mode=TransferMode.WRITE), rule="PAR-3")


@case("PAR-3", "gdn-tp-1-to-4", requires=["read", "notifications", "local_pools"])
def gdn_tp_1_to_4(ctx: CaseContext) -> None:
    """Gated DeltaNet, 2 K heads and 4 V heads, TP1 to TP4: Q and K replicated in pairs, V and state split."""
    play(ctx, _scenario(_layers(("g0", gdn_page())), 1, 4), rule="PAR-3")


@case("PAR-3", "kda-tp-4-to-2", requires=["read", "notifications", "local_pools"])
def kda_tp_4_to_2(ctx: CaseContext) -> None:
    """Kimi Delta Attention, TP4 to TP2: each consumer rank gathers Q, K, V and state from two producer ranks."""
    play(ctx, _scenario(_layers(("k0", kda_page())), 4, 2), rule="PAR-3")


@case("PAR-3", "sliding-window-hybrid", requires=["read", "notifications", "local_pools"])
def sliding_window_hybrid(ctx: CaseContext) -> None:
    """Full, sliding-window and GDN layers, TP2 to TP4: each layer's page sliced by its own sub-blocks."""
    layers = _layers(("full.0", attention_page(4)), ("sw.1", attention_page(4)), ("gdn.2", gdn_page()))
    play(ctx, _scenario(layers, 2, 4), rule="PAR-3")


# --------------------------------------------------------------------------- PAR-4 one elected source


@case("PAR-4", "gqa-replicas-tp-8-to-2", requires=["write", "notifications", "local_pools"])
def gqa_replicas_8_to_2(ctx: CaseContext) -> None:
    """TP8 to TP2 with 2 KV heads, WRITE: four producer ranks hold each head; exactly one writes it."""
    play(ctx, _scenario(_layers(("l0", attention_page(2))), 8, 2, mode=TransferMode.WRITE), rule="PAR-4")


@case("PAR-4", "mla-latent-tp-4-to-2", requires=["write", "notifications", "local_pools"])
def mla_latent_4_to_2(ctx: CaseContext) -> None:
    """MLA, TP4 to TP2, WRITE: every producer rank holds the latent; one per consumer rank writes it."""
    play(ctx, _scenario(_layers(("mla.0", mla_page())), 4, 2, mode=TransferMode.WRITE), rule="PAR-4")


# --------------------------------------------------------------------------- PAR-5 layout preconditions


@case("PAR-5", "opaque-refused-before-any-byte", requires=["local_pools"])
def opaque_refused(ctx: CaseContext) -> None:
    """An opaque page (interleaved scales) from TP1 to TP2 is refused by name before any byte moves."""
    scenario = _scenario(_layers(("l0", attention_page(4, order=PageOrder.OPAQUE))), 1, 2)
    ctx.last_reproducer = f"run_par_scenario({scenario!r}, backend=load_backend({ctx.backend_spec!r}))"
    result = run_par_scenario(scenario, backend=ctx.backend)
    if not isinstance(result.refused, ParallelismError) or "opaque" not in str(result.refused):
        found = result.refused or f"no refusal ({result.posted} transfers posted)"
        raise ctx.fail(f"PAR-5: expected a ParallelismError naming the 'opaque' order, got {found}")
    if result.problems or result.posted:
        raise ctx.fail("PAR-5: bytes moved before the refusal: " + "; ".join(result.problems))


# --------------------------------------------------------------------------- PAR-6 completion count


@case("PAR-6", "producer-waits-for-every-consumer-rank", requires=["read", "notifications", "local_pools"])
def waits_for_every_rank(ctx: CaseContext) -> None:
    """TP1 to TP4: the one producer rank frees after the fourth consumer rank's notification, not the first."""
    play(ctx, _scenario(_layers(("l0", attention_page(4))), 1, 4), rule="PAR-6")


@case("PAR-6", "mla-unread-ranks-notify", requires=["read", "notifications", "local_pools"])
def mla_unread_ranks_notify(ctx: CaseContext) -> None:
    """MLA, TP2 to TP1: producer rank 1 is read by nobody, yet frees only after the consumer rank notifies it."""
    play(ctx, _scenario(_layers(("mla.0", mla_page())), 2, 1), rule="PAR-6")


# --------------------------------------------------------------------------- PAR-7 identity pairing


def _pp_layers() -> tuple[ParLayer, ...]:
    # The consumer lists its layers by KV-cache group (attention, then GDN); the model orders them 0..3.
    return _layers(
        ("attn.0", attention_page(4)), ("attn.2", attention_page(4)), ("gdn.1", gdn_page()), ("gdn.3", gdn_page())
    )


@case("PAR-7", "pp2-tp2-to-tp4", requires=["read", "notifications", "local_pools"])
def pp2_tp2_to_tp4(ctx: CaseContext) -> None:
    """PP2 TP2 to TP4 (vLLM PR #53078): each stage gives its band of layers, paired by name, not by position."""
    stages = (("attn.0", "gdn.1"), ("attn.2", "gdn.3"))
    play(ctx, _scenario(_pp_layers(), 2, 4, producer_stages=stages), rule="PAR-7")


@case("PAR-7", "pp2-to-pp1-write", requires=["write", "notifications", "local_pools"])
def pp2_to_pp1_write(ctx: CaseContext) -> None:
    """PP2 to PP1 at TP1, WRITE: both stages write their layers into the one consumer rank by name."""
    stages = (("attn.0", "gdn.1"), ("attn.2", "gdn.3"))
    play(ctx, _scenario(_pp_layers(), 1, 1, producer_stages=stages, mode=TransferMode.WRITE), rule="PAR-7")


# --------------------------------------------------------------------------- PAR-8 DCP


@case("PAR-8", "dcp-2", requires=["read", "notifications", "local_pools"])
def dcp_2(ctx: CaseContext) -> None:
    """TP1 to TP1 with DCP2: DCP rank r holds tokens r, r + 2, ... of two producer blocks, in one block."""
    layers = _layers(("l0", attention_page(2, block_size=4)))
    play(ctx, _scenario(layers, 1, 1, consumer_dcp=2), rule="PAR-8")


@case("PAR-8", "dcp-2-interleave-2-tp-2", requires=["read", "notifications", "local_pools"])
def dcp_2_interleave_2(ctx: CaseContext) -> None:
    """TP2 to TP2 with DCP2, interleave 2, MLA and attention: tokens go round the DCP ranks two at a time."""
    layers = _layers(("l0", attention_page(2, block_size=4)), ("mla.1", mla_page(block_size=4)))
    play(ctx, _scenario(layers, 2, 2, consumer_dcp=2, dcp_interleave=2), rule="PAR-8")
