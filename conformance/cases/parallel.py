"""Many ranks to many: TP, PP and DCP exchanges, one agent and one pool per rank, checked against the canonical page.

Every case plays one request with :func:`run_par_scenario`: the producer
ranks' pages are projections of keyed canonical content, the connector under
test (kvspec's planner by default, :class:`kvspec.connector.ParallelConnector`)
plans every (producer rank, consumer rank), the backend under test moves the
bytes between one agent per rank, and the oracle checks every consumer rank's
pages against the projection of the canonical content onto what it owns,
every other byte unchanged, each consumer byte written once and each producer
rank freed after exactly the notifications the mapping implies
(docs/spec/parallelism.md, "What the suite checks"). Pages are tiny: a few
heads of 2 bytes, blocks of 2 or 4 tokens, 2 blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvspec import ParallelismError, TransferMode
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, SubBlock

from .._cases import case
from .._context import CaseContext
from .._parallel_scenario import ParLayer, ParScenario, run_par_scenario
from .._scenario import connector_replay

__all__ = ["SCENARIOS", "attention_page", "gdn_page", "kda_page", "mamba2_page", "mla_page", "play"]

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

# Case id -> the scenario it plays; reproducers name it here.
SCENARIOS: dict[str, ParScenario] = {}


def _layers(*pages: tuple[str, CanonicalPage]) -> tuple[ParLayer, ...]:
    return tuple(ParLayer(name=name, page=page) for name, page in pages)


def _reproducer(ctx: CaseContext, case_id: str) -> str:
    replay = connector_replay(ctx.connector)
    imports, connector = replay if replay is not None else ("", "None")
    return (
        f"{imports}"
        "from kvspec.transport import load_backend\n"
        "from kvspec_conformance._parallel_scenario import run_par_scenario\n"
        "from kvspec_conformance.cases.parallel import SCENARIOS\n"
        f"backend = load_backend({ctx.backend_spec!r})\n"
        f"print(run_par_scenario(SCENARIOS[{case_id!r}], backend=backend, connector={connector}))\n"
        "backend.close()"
    )


def play(ctx: CaseContext, case_id: str) -> None:
    """Run the case's scenario on the backend under test; fail with the oracle's findings and a reproducer."""
    scenario = SCENARIOS[case_id]
    rule = case_id.partition("/")[0]
    if scenario.mode not in ctx.capabilities.modes:
        raise ctx.skip(f"the backend does not support {scenario.mode.value.upper()}")
    ctx.last_reproducer = _reproducer(ctx, case_id)
    scaled = attrs.evolve(scenario, deadline=scenario.deadline * ctx.time_scale)
    result = run_par_scenario(scaled, backend=ctx.backend, connector=ctx.connector)
    if result.unsupported is not None:
        raise ctx.skip(f"the connector under test cannot express this case: {result.unsupported}")
    if result.refused is not None:
        raise ctx.fail(f"{rule}: planning refused a layout the rules admit: {result.refused}")
    if result.problems:
        shown = list(result.problems[:12])
        more = len(result.problems) - len(shown)
        raise ctx.fail(f"{rule}: " + "\n".join(shown + ([f"... and {more} more"] if more else [])))


def _register(rule: str, slug: str, title: str, scenario: ParScenario) -> None:
    """Register a case that plays ``scenario`` and passes when the oracle finds nothing."""
    case_id = f"{rule}/{slug}"
    SCENARIOS[case_id] = scenario

    def run(ctx: CaseContext) -> None:
        play(ctx, case_id)

    run.__doc__ = f"{title} ({scenario.mode.value.upper()})"
    case(rule, slug, requires=[scenario.mode.value, "notifications", "local_pools"])(run)


def _scenario(layers: tuple[ParLayer, ...], producer_tp: int, consumer_tp: int, **kw: Any) -> ParScenario:
    return ParScenario(layers=layers, producer_tp=producer_tp, consumer_tp=consumer_tp, **kw)


_READ, _WRITE = TransferMode.READ, TransferMode.WRITE

# --------------------------------------------------------------------------- PAR-1 ownership: TP pairs, both ways

for _p, _d in _PAIRS:
    _register(
        "PAR-1",
        f"tp-{_p}-to-{_d}",
        f"TP{_p} to TP{_d}, 8 KV heads: each consumer rank holds its heads' share of the canonical page",
        # Growing TP reads, shrinking TP writes: both modes cross every ratio.
        _scenario(
            _layers(("l0", attention_page(8)), ("l1", attention_page(8))), _p, _d, mode=_READ if _p < _d else _WRITE
        ),
    )

_register(
    "PAR-1",
    "kv-heads-fewer-than-tp",
    "TP1 to TP4 with 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1, never all head 0 (SGLang #23746)",
    _scenario(_layers(("l0", attention_page(2))), 1, 4),
)

# --------------------------------------------------------------------------- PAR-2 the page is a projection

_register(
    "PAR-2",
    "nhd-page-tp-2-to-4",
    "TP2 to TP4 with NHD pages (SGLang): a rank's heads are one run per token, not one run per head",
    _scenario(_layers(("l0", attention_page(4, block_size=4, order=PageOrder.NHD))), 2, 4),
)
_register(
    "PAR-2",
    "nhd-page-tp-2-to-1-write",
    "TP2 to TP1, NHD: both producer ranks write their heads' run into every token row",
    _scenario(_layers(("l0", attention_page(4, block_size=4, order=PageOrder.NHD))), 2, 1, mode=_WRITE),
)

# --------------------------------------------------------------------------- PAR-3 coverage of sub-blocks

_register(
    "PAR-3",
    "mamba2-n-groups-1",
    "Mamba-2, n_groups=1, TP1 to TP2: B and C whole on both ranks, x and SSM heads split (vLLM #55208)",
    _scenario(_layers(("m0", mamba2_page(1))), 1, 2),
)
_register(
    "PAR-3",
    "mamba2-n-groups-tp",
    "Mamba-2, n_groups=4, TP1 to TP4: x, B and C each split four ways, not the conv dim as one",
    _scenario(_layers(("m0", mamba2_page(4))), 1, 4, mode=_WRITE),
)
_register(
    "PAR-3",
    "gdn-tp-1-to-4",
    "Gated DeltaNet, 2 K heads and 4 V heads, TP1 to TP4: Q and K replicated in pairs, V and state split",
    _scenario(_layers(("g0", gdn_page())), 1, 4),
)
_register(
    "PAR-3",
    "kda-tp-4-to-2",
    "Kimi Delta Attention, TP4 to TP2: each consumer rank gathers Q, K, V and state from two producer ranks",
    _scenario(_layers(("k0", kda_page())), 4, 2),
)
_register(
    "PAR-3",
    "sliding-window-hybrid",
    "Full, sliding-window and GDN layers, TP2 to TP4: each layer's page sliced by its own sub-blocks",
    _scenario(_layers(("full.0", attention_page(4)), ("sw.1", attention_page(4)), ("gdn.2", gdn_page())), 2, 4),
)

# --------------------------------------------------------------------------- PAR-4 one elected source

_register(
    "PAR-4",
    "gqa-replicas-tp-8-to-2",
    "TP8 to TP2 with 2 KV heads: four producer ranks hold each head; exactly one writes it",
    _scenario(_layers(("l0", attention_page(2))), 8, 2, mode=_WRITE),
)
_register(
    "PAR-4",
    "mla-latent-tp-4-to-2",
    "MLA, TP4 to TP2: every producer rank holds the latent; one per consumer rank writes it",
    _scenario(_layers(("mla.0", mla_page())), 4, 2, mode=_WRITE),
)

_register(
    "PAR-4",
    "mla-latent-tp-2-to-1-write",
    "MLA, TP2 to TP1: both producer ranks hold the latent; only the elected one writes it",
    _scenario(_layers(("mla.0", mla_page())), 2, 1, mode=_WRITE),
)

# --------------------------------------------------------------------------- PAR-5 layout preconditions

SCENARIOS["PAR-5/opaque-refused-before-any-byte"] = _scenario(
    _layers(("l0", attention_page(4, order=PageOrder.OPAQUE))), 1, 2
)


@case("PAR-5", "opaque-refused-before-any-byte", requires=["local_pools"])
def opaque_refused(ctx: CaseContext) -> None:
    """An opaque page (interleaved scales) from TP1 to TP2 is refused by name before any byte moves."""
    case_id = "PAR-5/opaque-refused-before-any-byte"
    ctx.last_reproducer = _reproducer(ctx, case_id)
    result = run_par_scenario(SCENARIOS[case_id], backend=ctx.backend, connector=ctx.connector)
    if result.unsupported is not None:
        raise ctx.skip(f"the connector under test cannot express this case: {result.unsupported}")
    if not isinstance(result.refused, ParallelismError) or "opaque" not in str(result.refused):
        found = result.refused or f"no refusal ({result.posted} transfers posted)"
        raise ctx.fail(f"PAR-5: expected a ParallelismError naming the 'opaque' order, got {found}")
    if result.problems or result.posted:
        raise ctx.fail("PAR-5: bytes moved before the refusal: " + "; ".join(result.problems))


# --------------------------------------------------------------------------- PAR-6 completion count

_register(
    "PAR-6",
    "producer-waits-for-every-consumer-rank",
    "TP1 to TP4: the one producer rank frees after the fourth consumer rank's notification, not the first",
    _scenario(_layers(("l0", attention_page(4))), 1, 4),
)
_register(
    "PAR-6",
    "mla-unread-ranks-notify",
    "MLA, TP2 to TP1: producer rank 1 is read by nobody, yet frees only after the consumer rank notifies it",
    _scenario(_layers(("mla.0", mla_page())), 2, 1),
)

# --------------------------------------------------------------------------- PAR-7 identity pairing

# The consumer lists its layers by KV-cache group (attention, then GDN); the model and its stages order them 0..3.
_PP_LAYERS = _layers(
    ("attn.0", attention_page(4)), ("attn.2", attention_page(4)), ("gdn.1", gdn_page()), ("gdn.3", gdn_page())
)
_STAGES = (("attn.0", "gdn.1"), ("attn.2", "gdn.3"))

_register(
    "PAR-7",
    "pp2-tp2-to-tp4",
    "PP2 TP2 to TP4 (vLLM PR #53078): each stage gives its band of layers, paired by name, not by position",
    _scenario(_PP_LAYERS, 2, 4, producer_stages=_STAGES),
)
_register(
    "PAR-7",
    "pp2-to-pp1-write",
    "PP2 to PP1 at TP1: both stages write their layers into the one consumer rank by name",
    _scenario(_PP_LAYERS, 1, 1, producer_stages=_STAGES, mode=_WRITE),
)

# --------------------------------------------------------------------------- PAR-8 DCP

_register(
    "PAR-8",
    "dcp-2-interleave-1",
    "TP1 to TP1 with DCP2: DCP rank r holds tokens r, r + 2, ... of two producer blocks in one block",
    _scenario(_layers(("l0", attention_page(2, block_size=4))), 1, 1, consumer_dcp=2),
)
_register(
    "PAR-8",
    "dcp-2-interleave-2-tp-2",
    "TP2 to TP2 with DCP2, interleave 2, attention and MLA: tokens go round the DCP ranks two at a time",
    _scenario(
        _layers(("l0", attention_page(2, block_size=4)), ("mla.1", mla_page(block_size=4))),
        2,
        2,
        consumer_dcp=2,
        dcp_interleave=2,
    ),
)
