"""Cases on where a list sits in the request: the recomputed last token and declared list ends (protocol 1.1).

Both come from running vLLM 0.33.0's connectors through kvspec (issue 12):
vLLM builds its lists for the prompt length N while the consumer recomputes
token N - 1, and a list built from a table with lookahead slots can end one
block later than the other side's while both clip to the same length.
"""

from __future__ import annotations

import inspect

from kvspec import BlockAlignmentError, TransferMode, WindowCoverageError
from kvspec.connector import takes_keywords

from .._cases import case
from .._context import CaseContext
from .._scenario import Request, Scenario
from ..configs import full, make_config, sw

__all__: list[str] = []

# W = 6, B = 4: (N - W + 1) % B == 0 exactly when (N - 1) % B == 0, so every N below sits on both
# boundaries at once: the length check's ((N - 1) % B == 0) and the window's ((N - W + 1) % B == 0).
RECOMPUTE = make_config(full(4), sw(6, 4), num_blocks=64)
_PROMPTS = (9, 13, 17, 21)

# Two sliding-window groups and nothing else: every list is clipped, so lengths alone cannot show a shift.
# W = 8 (budget 3) and W = 12 (budget 4), B = 4.
SW_ONLY = make_config(sw(8, 4), sw(12, 4), num_blocks=64)


def _modes(ctx: CaseContext) -> list[str]:
    return [m.value for m in (TransferMode.READ, TransferMode.WRITE) if m in ctx.capabilities.modes]


def _require_keywords(ctx: CaseContext, rule: str, *names: str) -> None:
    """A connector written for protocol 1.0 cannot be told these; that fails the case, it does not error."""
    if not takes_keywords(ctx.connector):
        return  # pair_block_ids(config, request): the request carries every field (WIN-1, ALIGN-1)
    parameters = inspect.signature(ctx.connector.pair_block_ids).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [n for n in names if n not in parameters and not accepts_any]
    if missing:
        raise ctx.fail(
            f"{rule}: the connector's pair_block_ids takes no {', '.join(missing)} (protocol 1.1), "
            "so it cannot be told where the lists sit"
        )


@case("WIN-1", "recomputed-last-token-lists-for-prompt-length")
def _win_recompute(ctx: CaseContext) -> None:
    """Lists built for the prompt length N, with C recomputing token N - 1, load at (N - 1) % B == 0.

    vLLM builds both lists for N; C takes the KV of T = N - 1 tokens and
    recomputes the last (``recomputed_tokens=1``). Such lists are one block
    longer than ``cdiv(T, B)`` exactly when (N - 1) % B == 0, and must still
    load, with or without a prefix hit. The producer prunes with T (WIN-1).
    """
    _require_keywords(ctx, "WIN-1", "recomputed_tokens")
    requests = [
        Request(request_id=f"n{n}-h{h}", num_tokens=n - 1, recomputed_tokens=1, prefix_hit_tokens=h)
        for n in _PROMPTS
        for h in (0, 4)
    ]
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=RECOMPUTE, mode=mode, requests=requests))
        ctx.expect(result, loaded=[r.request_id for r in requests], rule="WIN-1")


def _pruned_with_prompt_length(n: int) -> list[list[int]]:
    """P's table for N tokens of RECOMPUTE, pruned with N (vLLM's num_computed_tokens) instead of T = N - 1."""
    blocks = -(-n // 4)
    skipped = (n - 6 + 1) // 4  # whole blocks before position N - W + 1, nulled by vLLM's pruning
    full_ids = list(range(1, blocks + 1))
    sw_ids = [0] * skipped + list(range(blocks + 1 + skipped, 2 * blocks + 1))
    return [full_ids, sw_ids]


@case("WIN-1", "recomputed-last-token-window-needs-token-n-minus-1")
def _win_recompute_window(ctx: CaseContext) -> None:
    """With C recomputing token N - 1, the window it needs starts at N - W, not N - W + 1.

    A producer that prunes with N nulls the block holding position N - W
    exactly when (N - W + 1) % B == 0; the recomputed token N - 1 attends it,
    so the request must fail with WindowCoverageError before any byte moves.
    A connector that checks the window of token N (the prompt length) loads
    it with that block missing.
    """
    _require_keywords(ctx, "WIN-1", "recomputed_tokens")
    requests = [
        Request(
            request_id=f"pruned-n{n}",
            num_tokens=n - 1,
            recomputed_tokens=1,
            producer_block_ids=_pruned_with_prompt_length(n),
        )
        for n in _PROMPTS
    ]
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=RECOMPUTE, mode=mode, requests=requests))
        ctx.expect(result, errors={r.request_id: WindowCoverageError for r in requests}, rule="WIN-1")


# T = 14, lookahead 3: P's table holds cdiv(17, 4) = 5 blocks, one past the request's last block 3.
# Group 0 (W = 8): pruned with T, block 0 is null; group 1 (W = 12): nothing is skipped.
_LOOKAHEAD_TABLE = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
_ALIGNED_TABLE = [[0, 11, 12, 13], [14, 15, 16, 17]]


@case("ALIGN-1", "list-shifted-by-lookahead-refused-by-its-end")
def _align_lookahead(ctx: CaseContext) -> None:
    """A list one block longer at the tail (lookahead slots) is refused although both clip to the same length.

    SW-only model, T = 14: C's lists need blocks 1..3 (W = 8) and 0..3
    (W = 12), exactly the budgets 3 and 4. P built its list from a table with
    lookahead slots for speculative decoding: 5 blocks, end 5. Clipped, both
    sides hold 3 and 4 ids, and tail alignment would pair every block with its
    neighbour. With the ends declared (protocol 1.1) the request must fail
    with BlockAlignmentError before any byte moves; the same lists with
    matching ends load.
    """
    _require_keywords(ctx, "ALIGN-1", "producer_block_ends", "consumer_block_ends")
    requests = [
        Request(
            request_id="lookahead",
            num_tokens=14,
            producer_block_ids=_LOOKAHEAD_TABLE,
            producer_block_ends=(5, 5),
            consumer_block_ends=(4, 4),
        ),
        Request(
            request_id="aligned",
            num_tokens=14,
            producer_block_ids=_ALIGNED_TABLE,
            producer_block_ends=(4, 4),
            consumer_block_ends=(4, 4),
        ),
    ]
    for mode in _modes(ctx):
        result = ctx.run(Scenario(config=SW_ONLY, mode=mode, requests=requests))
        ctx.expect(result, loaded=["aligned"], errors={"lookahead": BlockAlignmentError}, rule="ALIGN-1")
