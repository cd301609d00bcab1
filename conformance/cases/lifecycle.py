"""Cases on when things happen: completion, failures and faults, aborts, leases and releases."""

from __future__ import annotations

import attrs

from kvspec import FailureReason, ProducerState
from kvspec.transport import FaultPlan

from .._cases import case
from .._context import CaseContext
from .._scenario import LOAD_DEADLINE, Request, Scenario
from ..configs import full, make_config, sw

__all__: list[str] = []

CONFIG = make_config(full(4), sw(8, 4), num_blocks=96)
# Fault cases use short deadlines so that a lost message costs little time: sized for an in-process backend, doubled
# by default for agents in other processes, stretched further by --time-scale (decision 68 in decisions-testing.md).
DEADLINE, LEASE = 0.15, 0.2
# How long a scenario that reuses blocks keeps watching the pools after its last request (DONE-1, SM-2).
SETTLE = 0.6


_R = FailureReason
# The reasons FAIL-1 allows the consumer to report, per mode and situation (docs/spec/protocol-lifecycle.md,
# "Which reason"). A timeout is accepted only where the consumer cannot know better: in WRITE mode it learns
# of P's failure from P's message alone, and a lost peer or a dropped message leaves it only its deadline; and
# under random faults in either mode a read or write still PENDING at C's deadline (a slow backend, a loaded
# machine) ends there: the deadline bounds a slow transfer too (decision 80 in decisions-testing.md).
EXACT: dict[str, dict[str, frozenset[FailureReason]]] = {
    "read": {
        "partial": frozenset({_R.PARTIAL_TRANSFER}),
        "integrity": frozenset({_R.INTEGRITY}),
        "peer_lost": frozenset({_R.PEER_DISCONNECTED}),
        "random": frozenset({_R.POST_FAILED, _R.PARTIAL_TRANSFER, _R.TIMEOUT}),
    },
    "write": {
        "partial": frozenset({_R.PARTIAL_TRANSFER}),
        "integrity": frozenset({_R.INTEGRITY}),
        "peer_lost": frozenset({_R.PEER_DISCONNECTED, _R.TIMEOUT}),
        "random": frozenset({_R.POST_FAILED, _R.PARTIAL_TRANSFER, _R.TIMEOUT, _R.LEASE_EXPIRED}),
    },
}


def _modes(ctx: CaseContext) -> list[str]:
    return [m.value for m in sorted(ctx.capabilities.modes, key=lambda m: m.value)]


def _initiator(mode: str) -> str:
    return "consumer" if mode == "read" else "producer"


def _receiver(mode: str) -> str:
    return "producer" if mode == "read" else "consumer"


def _next_wave(prefix: str, wave: int = 1, count: int = 2, *, must_load: bool = True) -> list[Request]:
    # Requests that start after the faulty ones ended: they reuse the freed blocks and must load cleanly. Those
    # that must load get the generous deadline and lease of a load, so that a slow correct backend passes; the
    # scenario's short ones stay for the requests its fault ends (FAIL-1).
    return [
        _loading(r) if must_load else r
        for r in (
            Request(request_id=f"{prefix}{i}", num_tokens=14 + i, prefix_hit_tokens=4 * i, wave=wave)
            for i in range(count)
        )
    ]


def _loading(request: Request) -> Request:
    """``request`` with the deadline of a request that must load, whatever the scenario's (FAIL-1).

    Its lease outlasts that deadline by the fault cases' own lease, not by a load's: a lease runs out in full
    only where a release is lost, and there a broken backend would wait a load's lease out in every mode.
    """
    return attrs.evolve(request, deadline=LOAD_DEADLINE, lease=LOAD_DEADLINE + LEASE)


# --------------------------------------------------------------------------- DONE-1


@case("DONE-1", "read-done-means-visible", requires=["read"])
def _done_read(ctx: CaseContext) -> None:
    """When check() reports DONE every paired byte is already readable in the consumer's pool."""
    config = make_config(full(8), sw(16, 8), num_blocks=256, layers=4)
    requests = [Request(request_id=f"r{i}", num_tokens=40 + 7 * i) for i in range(6)]
    result = ctx.run(Scenario(config=config, requests=requests, mode="read"))
    ctx.expect(result, loaded=[r.request_id for r in requests], rule="DONE-1")


@case("DONE-1", "write-notification-after-data", requires=["write", "notifications"])
def _done_write(ctx: CaseContext) -> None:
    """The notification attached to a WRITE arrives only after every byte of it is readable at the consumer."""
    config = make_config(full(8), sw(16, 8), num_blocks=256, layers=4)
    requests = [Request(request_id=f"w{i}", num_tokens=40 + 7 * i) for i in range(6)]
    result = ctx.run(Scenario(config=config, requests=requests, mode="write"))
    ctx.expect(result, loaded=[r.request_id for r in requests], rule="DONE-1")


# --------------------------------------------------------------------------- FAIL-1 (faults of the injector)


@case("FAIL-1", "failed-post", requires=["notifications"])
def _fail_post(ctx: CaseContext) -> None:
    """A post that fails ends FAILED (post_failed) with nothing moved; the freed blocks load the next request."""
    for mode in _modes(ctx):
        plan = FaultPlan(fail_post=1.0)
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[
                Request(request_id="a", num_tokens=13),
                Request(request_id="b", num_tokens=17, prefix_hit_tokens=4),
            ],
            faults=plan,
            fault_side=_initiator(mode),
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        ctx.expect(result, failed={"a": FailureReason.POST_FAILED, "b": FailureReason.POST_FAILED}, rule="FAIL-1")


@case("FAIL-1", "partial-transfer", requires=["notifications"])
def _fail_partial(ctx: CaseContext) -> None:
    """A transfer that moves only part of its descriptors ends FAILED, never LOADED; later requests reuse the blocks."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=21), *_next_wave("n", must_load=False)],
            faults=FaultPlan(partial_transfer=1.0, skip_posts=0),
            fault_side=_initiator(mode),
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        # The initiator's transport reports the partial transfer; in WRITE mode P's Failure carries it to C.
        failed = {rid: EXACT[mode]["partial"] for rid in result.outcomes}
        ctx.expect(result, failed=failed, rule="FAIL-1")


@case("FAIL-1", "lost-notification", requires=["notifications"])
def _fail_lost(ctx: CaseContext) -> None:
    """Every notification to the receiver is lost: both sides still end within their deadlines, nothing leaks."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=13), Request(request_id="b", num_tokens=9)],
            faults=FaultPlan(drop_notifications=1.0),
            fault_side=_receiver(mode),
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        if mode == "read":
            # The consumer loads; the producer never hears the release and lets its lease expire (SM-1).
            ctx.expect(result, loaded=["a", "b"], rule="FAIL-1")
            states = {o.producer_state for o in result.outcomes.values()}
            if states != {ProducerState.EXPIRED}:
                found = sorted(state.value for state in states)
                raise ctx.fail(f"FAIL-1: the producer should have expired its leases, got {found}")
        else:
            ctx.expect(result, failed={"a": FailureReason.TIMEOUT, "b": FailureReason.TIMEOUT}, rule="FAIL-1")


@case("FAIL-1", "late-notification", requires=["notifications"])
def _fail_late(ctx: CaseContext) -> None:
    """Notifications delayed by a few polls still complete the requests correctly."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id=f"r{i}", num_tokens=10 + 3 * i) for i in range(4)],
            faults=FaultPlan(delay_notifications=1.0, delay_polls=3),
            fault_side="both",
        )
        ctx.expect(ctx.run(scenario), loaded=[f"r{i}" for i in range(4)], rule="FAIL-1")


@case("FAIL-1", "reordered-notifications", requires=["notifications"])
def _fail_reordered(ctx: CaseContext) -> None:
    """Notifications overtaken by later ones (reordered) still complete every request exactly once."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id=f"r{i}", num_tokens=9 + 4 * i) for i in range(5)],
            faults=FaultPlan(reorder_notifications=0.5, seed=3),
            fault_side="both",
        )
        ctx.expect(ctx.run(scenario), loaded=[f"r{i}" for i in range(5)], rule="FAIL-1")


@case("FAIL-1", "duplicate-notification", requires=["notifications"])
def _fail_duplicate(ctx: CaseContext) -> None:
    """Every notification delivered twice: duplicates are ignored, nothing is freed or loaded twice."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id=f"r{i}", num_tokens=10 + 3 * i) for i in range(3)] + _next_wave("n"),
            faults=FaultPlan(duplicate_notifications=1.0),
            fault_side="both",
        )
        ctx.expect(ctx.run(scenario), loaded=["r0", "r1", "r2", "n0", "n1"], rule="FAIL-1")


@case("INT-1", "corruption-with-integrity", requires=["integrity"])
def _fail_corrupt(ctx: CaseContext) -> None:
    """With integrity on, a corrupted transfer ends FAILED(integrity), never LOADED."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=15)],
            faults=FaultPlan(corrupt_page=1.0),
            fault_side=_initiator(mode),
            deadline=DEADLINE,
            lease=LEASE,
        )
        ctx.expect(ctx.run(scenario), failed={"a": EXACT[mode]["integrity"]}, rule="INT-1")


@case("FAIL-1", "peer-disconnect-then-rehandshake", requires=["notifications"])
def _fail_disconnect(ctx: CaseContext) -> None:
    """A peer disconnect fails the transfer in flight (peer_disconnected); after a new handshake the pair works."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=18), *_next_wave("n")],
            faults=FaultPlan(disconnect_at_post=1),
            fault_side=_initiator(mode),
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        ctx.expect(
            result,
            loaded=["n0", "n1"],
            failed={"a": EXACT[mode]["peer_lost"]},
            rule="FAIL-1",
        )


@case("FAIL-1", "peer-lost-mid-transfer", requires=["observable_in_flight"])
def _fail_native_disconnect(ctx: CaseContext) -> None:
    """The backend's own failure (the initiator forgets its peer mid-transfer) is reported FAILED, never done."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=18, disconnect_after_polls=0), *_next_wave("n")],
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        ctx.expect(
            result,
            loaded=["n0", "n1"],
            failed={"a": EXACT[mode]["peer_lost"]},
            rule="FAIL-1",
        )


@case("FAIL-1", "random-faults-under-load", requires=["notifications"])
def _fail_random(ctx: CaseContext) -> None:
    """Random drops, delays, duplicates, failed and partial posts under load: every request ends, nothing leaks."""
    for mode in _modes(ctx):
        for seed in range(2):
            plan = FaultPlan(
                seed=seed,
                drop_notifications=0.15,
                delay_notifications=0.15,
                duplicate_notifications=0.15,
                fail_post=0.15,
                partial_transfer=0.15,
            )
            requests = [
                Request(request_id=f"r{w}.{i}", num_tokens=6 + 5 * i, prefix_hit_tokens=4 * (i % 2), wave=w)
                for w in range(2)
                for i in range(5)
            ]
            scenario = Scenario(
                config=CONFIG,
                mode=mode,
                requests=requests,
                faults=plan,
                fault_side="both",
                deadline=DEADLINE,
                lease=LEASE,
            )
            result = ctx.run(scenario)
            loaded = [o.request_id for o in result.outcomes.values() if o.loaded]
            accepted = EXACT[mode]["random"]
            failed = {o.request_id: accepted for o in result.outcomes.values() if not o.loaded}
            ctx.expect(result, loaded=loaded, failed=failed, rule="FAIL-1")


@case("FAIL-1", "completed-reported-failed", requires=["notifications"])
def _fail_flipped(ctx: CaseContext) -> None:
    """A transfer that completed but is reported FAILED ends FAILED at its initiator, never LOADED on a FAILED.

    The injector's ``flip_status`` lets every byte land and the notification
    go, then reports ``FAILED(transfer_error)``. In READ mode the consumer is
    told, so the request ends FAILED. In WRITE mode the producer is told, but
    the consumer may already hold the Completion: it may end LOADED, and then
    every page must be right; either way one release, nothing held (REL-1, SM-1).
    """
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=13), Request(request_id="b", num_tokens=19)],
            faults=FaultPlan(flip_status=1.0),
            fault_side=_initiator(mode),
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        if mode == "read":
            ctx.expect(result, failed={"a": _R.TRANSFER_ERROR, "b": _R.TRANSFER_ERROR}, rule="FAIL-1")
            continue
        loaded = [o.request_id for o in result.outcomes.values() if o.loaded]
        ctx.expect(result, loaded=loaded, failed={r: None for r in ("a", "b") if r not in loaded}, rule="FAIL-1")


@case("DONE-1", "slow-posts-load-when-done", requires=["notifications"])
def _done_slow_posts(ctx: CaseContext) -> None:
    """Every post held back 60 ms (scaled) before it moves a byte: requests load, none before its data is there.

    The injector's ``post_latency`` keeps each transfer PENDING, with nothing
    moved, for that long after ``post`` returned; a side that counts a
    transfer done by time or by polls, not by ``check``, loads stale pages.
    """
    latency = 0.06  # seconds, scaled with --time-scale by FaultPlan.scaled like every time in a plan
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id=f"r{i}", num_tokens=9 + 5 * i) for i in range(3)] + _next_wave("n"),
            faults=FaultPlan(post_latency=latency),
            fault_side=_initiator(mode),
        )
        ctx.expect(ctx.run(scenario), loaded=["r0", "r1", "r2", "n0", "n1"], rule="DONE-1")


# --------------------------------------------------------------------------- SM-1, SM-2


@case("SM-1", "lease-expiry-frees-producer-blocks", requires=["notifications"])
def _sm1_lease(ctx: CaseContext) -> None:
    """A producer that never hears from the consumer expires its lease, frees its blocks, and ignores late signals."""
    for mode in _modes(ctx):
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=[Request(request_id="a", num_tokens=13)],
            faults=FaultPlan(drop_notifications=1.0),
            fault_side="producer",
            deadline=DEADLINE,
            lease=LEASE,
        )
        result = ctx.run(scenario)
        if result.outcome("a").producer_state is not ProducerState.EXPIRED:
            raise ctx.fail(f"SM-1: expected the producer's lease to expire\n{result.summary()}")
        if mode == "read":
            ctx.expect(result, loaded=["a"], rule="SM-1")
        else:
            ctx.expect(result, failed={"a": FailureReason.TIMEOUT}, rule="SM-1")


@case("SM-1", "producer-blocks-reused-after-release")
def _sm1_reuse(ctx: CaseContext) -> None:
    """Producer blocks freed on release are refilled for the next wave; the consumer gets new bytes, not stale ones."""
    requests = [Request(request_id=f"w{w}.{i}", num_tokens=11 + 4 * i, wave=w) for w in range(3) for i in range(3)]
    for mode in _modes(ctx):
        # Watch the pools after the last wave: a copy of wave 0 landing again later carries wave 2's bytes.
        result = ctx.run(Scenario(config=CONFIG, mode=mode, requests=requests, settle=SETTLE))
        ctx.expect(result, loaded=[r.request_id for r in requests], rule="SM-1")


@case("SM-2", "abort-mid-transfer-then-reuse", requires=["observable_in_flight"])
def _sm2_abort(ctx: CaseContext) -> None:
    """A consumer abort while LOADING drains before its blocks are reused: the next request's pages stay intact."""
    for mode in _modes(ctx):
        for polls in (0, 1):
            scenario = Scenario(
                config=CONFIG,
                mode=mode,
                requests=[
                    Request(request_id="a", num_tokens=22, abort_after_polls=polls),
                    Request(request_id="b", num_tokens=19, abort_after_polls=polls),
                    *_next_wave("n", count=3),
                ],
                deadline=DEADLINE,
                lease=LEASE,
                watch_late_writes=True,
            )
            result = ctx.run(scenario)
            outcome = {rid: result.outcome(rid) for rid in ("a", "b")}
            failed = {rid: FailureReason.ABORTED for rid, o in outcome.items() if not o.loaded}
            loaded = [rid for rid, o in outcome.items() if o.loaded]
            ctx.expect(result, loaded=["n0", "n1", "n2", *loaded], failed=failed, rule="SM-2")


@case("SM-2", "failed-request-never-loaded", requires=["write", "notifications"])
def _sm2_failed_sticky(ctx: CaseContext) -> None:
    """A request that timed out stays FAILED when its completion arrives late (terminal states are sticky)."""
    # WRITE: the completion travels as a notification to the consumer; hold it for 400 polls (each at least a
    # 0.5 ms pause) and for 0.25 s, five deadlines: the seconds follow --time-scale as the deadline does, so
    # the completion comes past the deadline at any scale, and usually before lease + drain, so that it meets
    # the FAILING request (and otherwise the FAILED one).
    scenario = Scenario(
        config=CONFIG,
        mode="write",
        requests=[Request(request_id="a", num_tokens=13), *_next_wave("n", must_load=False)],
        faults=FaultPlan(delay_notifications=1.0, delay_polls=400, delay_seconds=0.25),
        fault_side="consumer",
        deadline=0.05,
        lease=0.3,
    )
    result = ctx.run(scenario)
    ctx.expect(result, failed={rid: FailureReason.TIMEOUT for rid in result.outcomes}, rule="SM-2")


# --------------------------------------------------------------------------- REL-1


@case("REL-1", "one-release-per-request", requires=["notifications"])
def _rel_once(ctx: CaseContext) -> None:
    """Loaded, failed, aborted and full-prefix-hit requests each send exactly one release, and P gets each once."""
    for mode in _modes(ctx):
        requests = [
            _loading(Request(request_id="loaded", num_tokens=13)),
            _loading(Request(request_id="full-hit", num_tokens=12, prefix_hit_tokens=12)),
            Request(
                request_id="window-fail",
                num_tokens=14,
                producer_block_ids=[[1, 2, 3, 4], [0, 0, 5, 6]],
                consumer_block_ids=[[7, 8, 9, 10], [11, 12, 13]],
            ),
            Request(request_id="aborted", num_tokens=17, abort_after_polls=0),
        ]
        # The case counts releases, not lease expiries: the lease is ten times the others', so that a release a
        # busy machine delays (the consumer's and producer's agents starved for a while) is still counted; a
        # correct backend's release ends the request at once, and one that never comes still fails, later.
        lease = 10 * LEASE
        result = ctx.run(Scenario(config=CONFIG, mode=mode, requests=requests, deadline=DEADLINE, lease=lease))
        aborted = result.outcome("aborted")
        extra = {} if aborted.loaded else {"aborted": FailureReason.ABORTED}
        ctx.expect(
            result,
            loaded=["loaded", "full-hit", *([] if extra else ["aborted"])],
            failed={"window-fail": FailureReason.WINDOW_COVERAGE, **extra},
            rule="REL-1",
        )
        received = {o.request_id: o.releases_received for o in result.outcomes.values() if o.releases_received != 1}
        if received:
            raise ctx.fail(f"REL-1: the producer received {received} releases, expected exactly 1 each")


@case("REL-1", "repeated-release-is-noop", requires=["notifications"])
def _rel_repeat(ctx: CaseContext) -> None:
    """A release delivered twice is a no-op on the producer: its blocks are freed once and reused cleanly."""
    for mode in _modes(ctx):
        requests = [Request(request_id="a", num_tokens=13), Request(request_id="b", num_tokens=9), *_next_wave("n")]
        scenario = Scenario(
            config=CONFIG,
            mode=mode,
            requests=requests,
            faults=FaultPlan(duplicate_notifications=1.0),
            fault_side="producer",
        )
        ctx.expect(ctx.run(scenario), loaded=["a", "b", "n0", "n1"], rule="REL-1")
