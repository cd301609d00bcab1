"""Cases that need one agent on another host (``kvspec conform --peer``): the peer lost without a goodbye."""

from __future__ import annotations

from kvspec import ConsumerState, TransferMode

from .._cases import case
from .._context import CaseContext
from .._scenario import Request, Scenario
from ..configs import full, make_config, sw

__all__: list[str] = []

CONFIG = make_config(full(4), sw(8, 4), num_blocks=64)


@case("FAIL-1", "peer-agent-killed-mid-transfer", requires=["remote_pools"])
def _fail_peer_killed(ctx: CaseContext) -> None:
    """The producer's agent is killed right after the post: every request ends FAILED with a reason, never hangs."""
    modes = [m for m in (TransferMode.READ, TransferMode.WRITE) if m in ctx.capabilities.modes]
    for mode in modes:
        scenario = Scenario(
            config=CONFIG,
            mode=mode.value,
            requests=[
                Request(request_id="a", num_tokens=18, kill_peer_after_polls=0),
                Request(request_id="b", num_tokens=30),
            ],
            deadline=1.0,
            lease=2.0,
        )
        result = ctx.run(scenario)
        # "b" may have loaded before the kill or failed after it; either way it ended, with a reason if it failed.
        ctx.expect(result, failed={"a": None}, rule="FAIL-1")
        b = result.outcome("b")
        if b.consumer_state not in (ConsumerState.LOADED, ConsumerState.FAILED) or (
            b.consumer_state is ConsumerState.FAILED and b.reason is None
        ):
            raise ctx.fail(f"FAIL-1 ({mode.value}): b ended {b.consumer_state.name} with reason {b.reason}")
