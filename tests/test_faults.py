"""Injected faults: every request ends in bounded time with a typed outcome, and no block is freed mid-transfer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import attrs
import pytest

from kvspec import BlockIds, ConfigError, FailureReason, KVCacheConfig, KVSpecError, TransferMode, TransportError
from kvspec.drivers._exchange import ConsumerEndpoint, ProducerEndpoint, connect, run_request
from kvspec.presets import get_preset
from kvspec.protocol._session import ConsumerState, ProducerState
from kvspec.testing import (
    ExpectedLoad,
    PagePool,
    allocate_pool,
    check_pools,
    fill_background,
    fill_producer_pages,
)
from kvspec.transport import Descriptor, MemoryRegion, TransferState
from kvspec.transport.faults import FaultInjector, FaultPlan, FaultyBackend
from kvspec.transport.loopback import LoopbackAgent, LoopbackBackend

LEASE, GRACE, DRAIN = 0.5, 0.3, 0.2
# The longest any request may take: lease, then the producer's grace, plus polling slack (FAIL-1).
BOUND = LEASE + GRACE + DRAIN + 0.2

LOADED, FAILED = ConsumerState.LOADED, ConsumerState.FAILED
R, W = TransferMode.READ, TransferMode.WRITE


class SteppingClock:
    """Advances 1 ms per read: deadlines pass after a bounded number of polls, without sleeping."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@attrs.define
class Rig:
    producer: ProducerEndpoint
    consumer: ConsumerEndpoint
    producer_pool: PagePool
    consumer_pool: PagePool
    backend: FaultyBackend
    clock: SteppingClock
    violations: list[str]


def _inner(agent: object) -> LoopbackAgent:
    assert isinstance(agent, FaultInjector)
    inner = agent.inner
    assert isinstance(inner, LoopbackAgent)
    return inner


@pytest.fixture
def make_rig() -> Iterator[object]:
    rigs: list[Rig] = []

    def make(mode: TransferMode, plan: FaultPlan, model: str = "gpt-oss-20b") -> Rig:
        config: KVCacheConfig = get_preset(model).build_config(
            num_blocks=80, max_layers_per_group=2, head_size_divisor=64
        )
        backend = FaultyBackend(LoopbackBackend(chunk_bytes=512), plan)
        producer_pool, consumer_pool = allocate_pool(config, shared=False), allocate_pool(config, shared=False)
        fill_background(producer_pool, seed="p")
        fill_background(consumer_pool, seed="c")
        clock = SteppingClock()
        violations: list[str] = []
        producer_agent, consumer_agent = backend.create_agent("producer"), backend.create_agent("consumer")

        def guard(role: str, agent: object) -> object:
            # SM-1/SM-2: a block returns to the pool only once no pending transfer touches any of its pages.
            def on_free(ids: list[int]) -> None:
                for block_id in ids:
                    for group in config.kv_cache_groups:
                        page = group.kv_cache_spec.page_size_bytes
                        for layer in group.layer_names:
                            region, offset = config.page_offset(layer, block_id)
                            if _inner(agent).touches(region, offset, page):
                                violations.append(f"{role} freed block {block_id} ({layer}) mid-transfer")

            return on_free

        producer = ProducerEndpoint(
            engine_id="P", config=config, transport=producer_agent, regions=producer_pool.regions, mode=mode,
            clock=clock, lease_duration=LEASE, release_grace=GRACE, drain_timeout=DRAIN,
            on_free=guard("producer", producer_agent),  # type: ignore[arg-type]
        )  # fmt: skip
        consumer = ConsumerEndpoint(
            engine_id="C", config=config, transport=consumer_agent, regions=consumer_pool.regions, mode=mode,
            clock=clock, drain_timeout=DRAIN, on_free=guard("consumer", consumer_agent),  # type: ignore[arg-type]
        )  # fmt: skip
        connect(producer, consumer)
        rig = Rig(producer, consumer, producer_pool, consumer_pool, backend, clock, violations)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.backend.close()
        rig.producer_pool.close()
        rig.consumer_pool.close()


def run_one(rig: Rig, request_id: str = "r", num_tokens: int = 300) -> tuple[ConsumerState, object, list[str]]:
    """Run one request; return its consumer state, failure reason and oracle mismatches."""
    free = (rig.producer.num_free_blocks, rig.consumer.num_free_blocks)
    consumer_before = rig.consumer_pool.snapshot()
    snapshots = []

    def fill(ids: BlockIds) -> None:
        fill_producer_pages(rig.producer_pool, ids, num_tokens=num_tokens, salt=request_id)
        snapshots.append(rig.producer_pool.snapshot())

    start = rig.clock.now
    result = run_request(
        rig.producer,
        rig.consumer,
        request_id=request_id,
        num_tokens=num_tokens,
        fill=fill,
        idle=lambda: None,
    )
    elapsed = rig.clock.now - start
    assert elapsed <= BOUND, f"request took {elapsed:.3f} s of clock, bound {BOUND} s (FAIL-1)"
    assert not rig.violations, rig.violations
    assert (rig.producer.num_free_blocks, rig.consumer.num_free_blocks) == free
    assert result.producer.state.is_terminal
    state = result.consumer.state
    failure = result.consumer.failure
    # FAIL-1: FAILED always carries a typed reason and the consumer blocks that may be bad.
    assert (state is FAILED) == (failure is not None)
    if failure is not None:
        assert isinstance(failure.reason, FailureReason)
        assert failure.failed_consumer_block_ids.num_blocks > 0
    load = ExpectedLoad(
        producer_block_ids=result.consumer.producer_block_ids,
        consumer_block_ids=result.consumer.consumer_block_ids,
        num_tokens=num_tokens,
        salt=request_id,
        loaded=state is LOADED,
    )
    mismatches = check_pools(
        producer=rig.producer_pool,
        consumer=rig.consumer_pool,
        producer_before=snapshots[0],
        consumer_before=consumer_before,
        loads=[load],
    )
    return state, None if failure is None else failure.reason, [str(m) for m in mismatches]


DISCONNECTED = {FailureReason.PEER_DISCONNECTED}
# A lost message is noticed when the lease runs out.
LOST = {FailureReason.LEASE_EXPIRED, FailureReason.TIMEOUT}

CASES = [
    # (id, plan, mode, consumer state, accepted reasons)
    ("fail-post", FaultPlan(fail_post=1.0), R, FAILED, {FailureReason.POST_FAILED}),
    ("fail-post", FaultPlan(fail_post=1.0), W, FAILED, {FailureReason.POST_FAILED}),
    ("partial", FaultPlan(partial_transfer=1.0), R, FAILED, {FailureReason.PARTIAL_TRANSFER}),
    ("partial", FaultPlan(partial_transfer=1.0), W, FAILED, {FailureReason.PARTIAL_TRANSFER}),
    ("disconnect-before", FaultPlan(disconnect_at_post=0), R, FAILED, DISCONNECTED),
    ("disconnect-before", FaultPlan(disconnect_at_post=0), W, FAILED, DISCONNECTED),
    ("disconnect-in-flight", FaultPlan(disconnect_at_post=1), R, FAILED, DISCONNECTED),
    ("disconnect-in-flight", FaultPlan(disconnect_at_post=1), W, FAILED, DISCONNECTED | LOST),
    ("drop-all", FaultPlan(drop_notifications=1.0), W, FAILED, LOST),
    ("drop-completion", FaultPlan(drop_notifications=1.0, agents="consumer"), W, FAILED, LOST),
    ("delay-past-lease", FaultPlan(delay_notifications=1.0, delay_polls=10**6), W, FAILED, LOST),
    # READ needs no message to load: a lost release costs the producer a lease, not the consumer its data.
    ("drop-all", FaultPlan(drop_notifications=1.0), R, LOADED, set()),
    ("delay", FaultPlan(delay_notifications=1.0, delay_polls=5), R, LOADED, set()),
    ("delay", FaultPlan(delay_notifications=1.0, delay_polls=5), W, LOADED, set()),
    ("duplicate", FaultPlan(duplicate_notifications=1.0), R, LOADED, set()),
    ("duplicate", FaultPlan(duplicate_notifications=1.0), W, LOADED, set()),
    ("reorder", FaultPlan(reorder_notifications=1.0), R, LOADED, set()),
    ("reorder", FaultPlan(reorder_notifications=1.0), W, LOADED, set()),
]


@pytest.mark.parametrize(
    ("plan", "mode", "expected", "reasons"),
    [pytest.param(*case[1:], id=f"{case[0]}-{case[2].value}") for case in CASES],
)
def test_request_under_fault_ends_typed_and_bounded(
    make_rig: object, plan: FaultPlan, mode: TransferMode, expected: ConsumerState, reasons: set[FailureReason]
) -> None:
    """Each injected fault: the request ends with the expected state and a typed reason, in bounded time (FAIL-1)."""
    rig = make_rig(mode, plan)  # type: ignore[operator]
    state, reason, mismatches = run_one(rig)
    assert state is expected, (reason, rig.consumer.errors, rig.producer.errors, rig.backend.injected)
    if expected is FAILED:
        assert reason in reasons
    # Every page outside a failed request's blocks is untouched; a loaded request is byte-exact.
    assert not mismatches, "\n".join(mismatches[:5])
    assert rig.backend.injected, "the fault never fired"


@pytest.mark.parametrize("mode", [R, W], ids=lambda m: m.value)
def test_corruption_is_caught_by_the_oracle(make_rig: object, mode: TransferMode) -> None:
    """Loopback has no integrity check: a corrupted page reaches LOADED; only the oracle sees it (DESIGN section 4)."""
    rig = make_rig(mode, FaultPlan(corrupt_page=1.0))  # type: ignore[operator]
    state, _, mismatches = run_one(rig)
    assert state is LOADED
    assert mismatches


@pytest.mark.parametrize("mode", [R, W], ids=lambda m: m.value)
def test_random_faults_under_load(make_rig: object, mode: TransferMode) -> None:
    """Seeded random faults over many interleaved requests: all end, counts return to baseline (FAIL-1, REL-1)."""
    plan = FaultPlan(
        seed=7,
        drop_notifications=0.1,
        duplicate_notifications=0.2,
        delay_notifications=0.1,
        reorder_notifications=0.2,
        fail_post=0.1,
        partial_transfer=0.1,
    )
    rig = make_rig(mode, plan)  # type: ignore[operator]
    free = (rig.producer.num_free_blocks, rig.consumer.num_free_blocks)
    outcomes = []
    for round_ in range(3):
        ids = [f"q{round_}-{i}" for i in range(4)]
        for i, request_id in enumerate(ids):
            params = rig.producer.prefill(request_id, num_tokens=40 + 50 * i)
            rig.consumer.begin(params)
        for _ in range(5000):
            if not rig.consumer.active_requests and not rig.producer.active_requests:
                break
            rig.consumer.poll()
            rig.producer.poll()
        else:
            pytest.fail(f"requests still active: {rig.consumer.active_requests} {rig.producer.active_requests}")
        for request_id in ids:
            result = rig.consumer.result(request_id)
            assert result is not None
            assert result.state in (LOADED, FAILED)
            assert (result.state is FAILED) == (result.failure is not None)
            outcomes.append(result.state)
            rig.consumer.finish(request_id)
    assert not rig.violations, rig.violations
    assert (rig.producer.num_free_blocks, rig.consumer.num_free_blocks) == free
    assert LOADED in outcomes
    assert FAILED in outcomes


def test_same_seed_replays_the_same_faults() -> None:
    def fired(seed: int) -> tuple[object, ...]:
        backend = FaultyBackend(LoopbackBackend(), FaultPlan(seed=seed, drop_notifications=0.5))
        a, b = backend.create_agent("a"), backend.create_agent("b")
        a.register_memory([MemoryRegion(buffer=memoryview(bytearray(8)))])
        b.register_memory([MemoryRegion(buffer=memoryview(bytearray(8)))])
        a.add_remote_agent(b.get_agent_metadata())
        for i in range(40):
            a.send_notification("b", b"%d" % i)
        delivered = tuple(n.message for n in b.get_notifications())
        backend.close()
        return delivered

    assert fired(1) == fired(1)
    assert fired(1) != fired(2)


def test_reorder_delivers_behind_the_next_and_never_loses() -> None:
    backend = FaultyBackend(LoopbackBackend(), FaultPlan(reorder_notifications=1.0, agents="b"))
    a, b = backend.create_agent("a"), backend.create_agent("b")
    a.add_remote_agent(b.get_agent_metadata())
    for i in range(3):
        a.send_notification("b", b"%d" % i)
    got: list[bytes] = []
    for _ in range(5):
        got.extend(n.message for n in b.get_notifications())
    assert sorted(got) == [b"0", b"1", b"2"]
    backend.close()


def test_disconnect_refuses_posts_and_sends_until_re_added() -> None:
    backend = FaultyBackend(LoopbackBackend(), FaultPlan(disconnect_at_post=0, agents="a"))
    a, b = backend.create_agent("a"), backend.create_agent("b")
    a.register_memory([MemoryRegion(buffer=memoryview(bytearray(16)))])
    b.register_memory([MemoryRegion(buffer=memoryview(bytearray(16)))])
    a.add_remote_agent(b.get_agent_metadata())
    # Adding the peer is the re-handshake that clears a disconnect; cut it again by plan at the first post.
    backend2 = FaultyBackend(LoopbackBackend(), FaultPlan(disconnect_at_post=1))
    c, d = backend2.create_agent("c"), backend2.create_agent("d")
    c.register_memory([MemoryRegion(buffer=memoryview(bytearray(16)))])
    d.register_memory([MemoryRegion(buffer=memoryview(bytearray(16)))])
    c.add_remote_agent(d.get_agent_metadata())
    desc = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=8)
    handle = c.post(TransferMode.WRITE, [desc], peer="d")
    status = c.check(handle)
    assert status.state is TransferState.FAILED
    assert status.reason is FailureReason.PEER_DISCONNECTED
    with pytest.raises(TransportError, match=r"fault injector: peer 'd' disconnected"):
        c.post(TransferMode.WRITE, [desc], peer="d")
    with pytest.raises(TransportError, match=r"fault injector: peer 'd' disconnected"):
        c.send_notification("d", b"x")
    c.add_remote_agent(d.get_agent_metadata())
    c.send_notification("d", b"back")
    assert [n.message for n in d.get_notifications()] == [b"back"]
    backend.close()
    backend2.close()


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"drop_notifications: expected a probability in \[0, 1\], got 1\.5"):
        FaultPlan(drop_notifications=1.5)
    with pytest.raises(ConfigError, match=r"FaultPlan\.delay_polls: expected a non-negative int, got -1"):
        FaultPlan(delay_polls=-1)
    assert FaultPlan(agents="x").applies_to("x")
    assert not FaultPlan(agents=["x"]).applies_to("y")


def test_producer_expires_when_consumer_vanishes(make_rig: object) -> None:
    """READ: the consumer never begins; the producer frees at lease + grace (SM-1: the lease)."""
    rig = make_rig(R, FaultPlan())  # type: ignore[operator]
    free = rig.producer.num_free_blocks
    rig.producer.prefill("orphan", num_tokens=100)
    for _ in range(5000):
        rig.producer.poll()
        if rig.producer.result("orphan") is not None:
            break
    result = rig.producer.result("orphan")
    assert result is not None
    assert result.state is ProducerState.EXPIRED
    assert rig.producer.num_free_blocks == free


@pytest.mark.parametrize("mode", [R, W], ids=lambda m: m.value)
def test_consumer_abort_mid_transfer_waits_for_drain(make_rig: object, mode: TransferMode) -> None:
    """Abort while LOADING: blocks are freed only after the transfer drained; one release (SM-2, REL-1)."""
    rig = make_rig(mode, FaultPlan())  # type: ignore[operator]
    free = (rig.producer.num_free_blocks, rig.consumer.num_free_blocks)
    params = rig.producer.prefill("a", num_tokens=300)
    rig.consumer.begin(params)
    rig.producer.poll()  # WRITE: P sees the offer and posts; READ: C already posted
    rig.consumer.abort("a")
    for _ in range(5000):
        if not rig.consumer.active_requests and not rig.producer.active_requests:
            break
        rig.consumer.poll()
        rig.producer.poll()
    result = rig.consumer.result("a")
    assert result is not None
    assert result.state is ConsumerState.ABORTED
    assert not rig.violations, rig.violations
    assert (rig.producer.num_free_blocks, rig.consumer.num_free_blocks) == free


def test_partial_transfer_moves_some_bytes_then_fails() -> None:
    """Half the bytes land, then FAILED with partial_transfer, and the notification never arrives (FAIL-1)."""
    backend = FaultyBackend(LoopbackBackend(), FaultPlan(partial_transfer=1.0))
    a, b = backend.create_agent("a"), backend.create_agent("b")
    src, dst = bytearray(b"\x07" * 64), bytearray(64)
    a.register_memory([MemoryRegion(buffer=memoryview(src))])
    b.register_memory([MemoryRegion(buffer=memoryview(dst))])
    a.add_remote_agent(b.get_agent_metadata())
    desc = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=64)
    handle = a.post(TransferMode.WRITE, [desc], peer="b", notification=b"done")
    for _ in range(5):
        status = a.check(handle)
        if status.state is not TransferState.PENDING:
            break
    assert status.state is TransferState.FAILED
    assert status.reason is FailureReason.PARTIAL_TRANSFER
    assert dst == bytearray(b"\x07" * 32 + b"\x00" * 32)
    assert b.get_notifications() == []
    backend.close()


def _write_pair(plan: FaultPlan) -> tuple[FaultyBackend, FaultInjector, FaultInjector, bytearray]:
    backend = FaultyBackend(LoopbackBackend(), plan)
    a, b = backend.create_agent("a"), backend.create_agent("b")
    dst = bytearray(64)
    a.register_memory([MemoryRegion(buffer=memoryview(bytearray(b"\x07" * 64)))])
    b.register_memory([MemoryRegion(buffer=memoryview(dst))])
    a.add_remote_agent(b.get_agent_metadata())
    return backend, a, b, dst


_ALL = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=64)


def test_flip_status_reports_a_completed_transfer_failed() -> None:
    """Every byte lands and the notification goes, then FAILED(transfer_error), for good (FAIL-1)."""
    backend, a, b, dst = _write_pair(FaultPlan(flip_status=1.0, agents="a"))
    handle = a.post(TransferMode.WRITE, [_ALL], peer="b", notification=b"done")
    statuses = [a.check(handle) for _ in range(5)]
    assert [s.state for s in statuses[-2:]] == [TransferState.FAILED] * 2
    assert statuses[-1].reason is FailureReason.TRANSFER_ERROR
    assert "completed" in statuses[-1].detail
    assert dst == bytearray(b"\x07" * 64)
    assert [n.message for n in b.get_notifications()] == [b"done"]
    assert [f.kind for f in backend.injected] == ["flip_status"]
    backend.close()


def test_flip_status_keeps_the_other_faults_sequence() -> None:
    """A plan without a flip replays the faults it always did: the flip draws from a sequence of its own."""

    def fired(plan: FaultPlan) -> list[str]:
        backend, a, _b, _ = _write_pair(plan)
        for _ in range(20):
            with contextlib.suppress(TransportError):
                a.release(a.post(TransferMode.WRITE, [_ALL], peer="b"))
        backend.close()
        return [f.detail for f in backend.injected if f.kind == "fail_post"]

    assert fired(FaultPlan(seed=4, fail_post=0.5)) == fired(FaultPlan(seed=4, fail_post=0.5, flip_status=0.5))


def test_post_latency_holds_the_post_then_moves_it() -> None:
    """PENDING with no byte moved until the latency passed, then DONE with every byte (DONE-1)."""
    backend, a, b, dst = _write_pair(FaultPlan(post_latency=0.05, agents="a"))
    handle = a.post(TransferMode.WRITE, [_ALL], peer="b", notification=b"done")
    assert a.check(handle).state is TransferState.PENDING
    assert dst == bytearray(64)
    assert b.get_notifications() == []
    deadline = time.monotonic() + 5
    while (status := a.check(handle)).state is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.005)
    assert status.state is TransferState.DONE
    assert dst == bytearray(b"\x07" * 64)
    a.release(handle)
    # Released while held: nothing ever moves.
    dst[:] = bytes(64)
    a.release(a.post(TransferMode.WRITE, [_ALL], peer="b"))
    time.sleep(0.06)
    a.get_notifications()
    assert dst == bytearray(64)
    backend.close()


def test_fail_registration_registers_nothing() -> None:
    """register_memory raises TransportError and the inner agent has no memory: a post into it is refused."""
    backend = FaultyBackend(LoopbackBackend(), FaultPlan(fail_registration=True, agents="b"))
    a, b = backend.create_agent("a"), backend.create_agent("b")
    a.register_memory([MemoryRegion(buffer=memoryview(bytearray(64)))])
    with pytest.raises(TransportError, match="registration of 1 regions failed"):
        b.register_memory([MemoryRegion(buffer=memoryview(bytearray(64)))])
    a.add_remote_agent(b.get_agent_metadata())
    with pytest.raises(KVSpecError):
        a.post(TransferMode.WRITE, [_ALL], peer="b")
    backend.close()


def test_bad_engine_fault_values_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"FaultPlan\.post_latency: expected seconds in \[0, 60\], got -1"):
        FaultPlan(post_latency=-1)
    with pytest.raises(ConfigError, match=r"FaultPlan\.fail_registration: expected True or False, got 1"):
        FaultPlan(fail_registration=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"FaultPlan\.flip_status: expected a probability"):
        FaultPlan(flip_status=2)


def test_a_held_post_refused_when_it_goes_ends_failed() -> None:
    """A post held by post_latency whose peer is gone by then ends FAILED with the inner agent's reason."""
    backend, a, _b, _ = _write_pair(FaultPlan(post_latency=0.02, agents="a"))
    handle = a.post(TransferMode.WRITE, [_ALL], peer="b")
    a.inner.remove_remote_agent("b")
    time.sleep(0.03)
    status = a.check(handle)
    assert status.state is TransferState.FAILED
    assert status.reason is FailureReason.PEER_DISCONNECTED
    assert "delayed post refused" in status.detail
    assert a.check(handle) == status
    a.release(handle)
    backend.close()
