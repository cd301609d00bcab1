"""Direct cases on the Transport API alone: no session and no driver, the suite's own memory is the oracle.

Each case creates a producer and a consumer agent of the backend under test,
registers two shared-memory regions on each, and calls the interface methods
itself. READ is posted by the consumer (bytes go producer -> consumer), WRITE by
the producer (producer -> consumer), so the destination is always the
consumer's memory and the source the producer's. Every bound is multiplied by
``--time-scale``; no case depends on how fast one machine is, only on whether a
bounded wait ends the way the rule says.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import attrs

from kvspec import (
    BlockIds,
    BlockPairs,
    FailureReason,
    KVCacheConfig,
    KVSpecError,
    PageDigester,
    PlanError,
    TransferMode,
    TransportError,
    plan_transfer,
)
from kvspec.testing import PagePool, allocate_pool
from kvspec.transport import (
    Backend,
    Descriptor,
    FaultPlan,
    FaultyBackend,
    Notification,
    Pace,
    PacedBackend,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
)
from kvspec.transport.pace import PACES

from .._cases import case
from .._context import CaseContext
from ..configs import full, make_config

__all__: list[str] = []

# Two regions a side (one tensor per group, 2 layers of 16-byte pages): 32 KiB a region.
CONFIG = make_config(full(4), full(4), num_blocks=1024)
# Large enough (2 x 1 MiB a side) that a backend claiming observable_in_flight shows the transfer PENDING.
LARGE = make_config(full(4), full(4), num_blocks=32768)

# Bounds, in seconds before --time-scale. Generous: a passing backend ends far sooner; only a wrong one waits them out.
DONE_BOUND = 10.0  # a transfer of a few KiB to 2 MiB reaches DONE or FAILED within this
LOSS_BOUND = 2.0  # a lost peer is reported within this: well under any lease (vLLM's NIXL uses 30 s)
SETTLE = 0.6  # how long the suite keeps watching memory for a stray late copy (one landing 0.5 s late is seen)
DRAIN = 1.0  # without immediate_cancel, a released transfer may move bytes this long (SM-2's drain, scaled down)
ECHO = 0.1  # how long the suite waits for a duplicate notification after the first one


def _modes(ctx: CaseContext) -> list[TransferMode]:
    return sorted(ctx.capabilities.modes, key=lambda m: m.value)


def _noise(nbytes: int, *key: object) -> bytes:
    return random.Random(":".join(map(str, ("transport", *key)))).randbytes(nbytes)


@attrs.define(eq=False)
class _Pair:
    """A producer and a consumer agent of one backend, each with its own registered pool, known to each other."""

    ctx: CaseContext
    producer: Transport
    consumer: Transport
    p_pool: PagePool
    c_pool: PagePool
    producer_name: str  # the producer as the consumer knows it
    consumer_name: str  # the consumer as the producer knows it
    inbox: dict[str, list[Notification]] = attrs.field(factory=lambda: {"producer": [], "consumer": []})

    def initiator(self, mode: TransferMode) -> Transport:
        return self.consumer if mode is TransferMode.READ else self.producer

    def target(self, mode: TransferMode) -> Transport:
        return self.producer if mode is TransferMode.READ else self.consumer

    def peer(self, mode: TransferMode) -> str:
        """The name under which the initiator of ``mode`` knows its target."""
        return self.producer_name if mode is TransferMode.READ else self.consumer_name

    def source(self, mode: TransferMode, d: Descriptor) -> memoryview:
        region, offset = (
            (d.remote_region, d.remote_offset) if mode is TransferMode.READ else (d.local_region, d.local_offset)
        )
        return self.p_pool.regions[region].buffer[offset : offset + d.nbytes]

    def poll(self) -> None:
        """Let both agents progress (a passive side progresses on get_notifications); keep what arrives."""
        for role, agent in (("producer", self.producer), ("consumer", self.consumer)):
            with contextlib.suppress(TransportError):  # an agent a case closed on purpose
                self.inbox[role] += agent.get_notifications()

    def watch(self, seconds: float) -> None:
        """Keep both agents progressing for ``seconds`` (scaled), so a stray late copy can land."""
        until = time.monotonic() + seconds * self.ctx.time_scale
        while True:
            self.poll()  # last after the period ends, however late a sleep wakes: a copy due by then has landed
            if time.monotonic() >= until:
                return
            time.sleep(0.002)

    def wait(self, mode: TransferMode, handles: Sequence[TransferHandle], bound: float) -> list[TransferStatus]:
        """Poll ``handles`` until none is PENDING or ``bound`` (scaled) passes; the last status of each."""
        initiator = self.initiator(mode)
        statuses = [initiator.check(h) for h in handles]
        until = time.monotonic() + bound * self.ctx.time_scale
        while any(s.state is TransferState.PENDING for s in statuses) and time.monotonic() < until:
            self.poll()
            statuses = [
                s if s.state is not TransferState.PENDING else initiator.check(h)
                for h, s in zip(handles, statuses, strict=True)
            ]
            time.sleep(0.0005)
        return statuses


@contextlib.contextmanager
def _pair(
    ctx: CaseContext, *, config: KVCacheConfig = CONFIG, backend: Backend | None = None, handshake: bool = True
) -> Iterator[_Pair]:
    """Two agents with their pools registered; ``handshake=False`` leaves loading each other's metadata to the case."""
    backend = backend or ctx.backend
    with allocate_pool(config) as p_pool, allocate_pool(config) as c_pool:
        for pool, side in ((p_pool, "producer"), (c_pool, "consumer")):
            for index, region in enumerate(pool.regions):
                region.buffer[:] = _noise(region.nbytes, "background", side, index)
        producer = backend.create_agent("producer")
        try:
            consumer = backend.create_agent("consumer")
        except BaseException:
            producer.close()
            raise
        try:
            producer.register_memory(p_pool.regions)
            consumer.register_memory(c_pool.regions)
            producer_name = consumer_name = ""
            if handshake:
                producer_name = consumer.add_remote_agent(producer.get_agent_metadata())
                consumer_name = producer.add_remote_agent(consumer.get_agent_metadata())
            yield _Pair(
                ctx=ctx,
                producer=producer,
                consumer=consumer,
                p_pool=p_pool,
                c_pool=c_pool,
                producer_name=producer_name,
                consumer_name=consumer_name,
            )
        finally:
            for agent in (consumer, producer):
                with contextlib.suppress(KVSpecError):
                    agent.close()


def _spread(pair: _Pair, mode: TransferMode, *, count: int, nbytes: int, start: int = 0) -> list[Descriptor]:
    """``count`` descriptors alternating regions, the remote side in reverse order, so a swap is seen."""
    size = pair.c_pool.regions[0].nbytes
    stride = nbytes + 13  # gaps between ranges: a copy that spills over its end is seen
    if start + count * stride > size:
        raise ValueError(f"_spread: {count} x {nbytes} bytes from {start} do not fit a region of {size}")
    return [
        Descriptor(
            local_region=i % 2,
            local_offset=start + i * stride,
            remote_region=(i + 1) % 2,
            remote_offset=start + (count - 1 - i) * stride,
            nbytes=nbytes,
        )
        for i in range(count)
    ]


def _fresh_source(pair: _Pair, mode: TransferMode, descriptors: Sequence[Descriptor], *key: object) -> None:
    for i, d in enumerate(descriptors):
        pair.source(mode, d)[:] = _noise(d.nbytes, "source", mode.value, i, *key)


def _expected(
    pair: _Pair, mode: TransferMode, descriptors: Sequence[Descriptor], before: Sequence[bytes]
) -> list[bytes]:
    """The consumer's regions as ``before`` with every descriptor's source bytes copied in (last one wins)."""
    regions = [bytearray(b) for b in before]
    for d in descriptors:
        region, offset = (
            (d.local_region, d.local_offset) if mode is TransferMode.READ else (d.remote_region, d.remote_offset)
        )
        regions[region][offset : offset + d.nbytes] = pair.source(mode, d)
    return [bytes(r) for r in regions]


def _snapshot(pool: PagePool) -> list[bytes]:
    return [bytes(r.buffer) for r in pool.regions]


def _diff(label: str, found: Sequence[bytes], wanted: Sequence[bytes]) -> str | None:
    """Where two snapshots of a pool first differ, or None."""
    for region, (a, b) in enumerate(zip(found, wanted, strict=True)):
        if a != b:
            first = next(i for i in range(len(a)) if a[i] != b[i])
            last = max(i for i in range(len(a)) if a[i] != b[i])
            return f"{label}: region {region} differs in bytes [{first}, {last}] ({len(a)} bytes)"
    return None


def _status_text(status: TransferStatus) -> str:
    reason = f" {status.reason.value}" if status.reason is not None else ""
    return f"{status.state.value.upper()}{reason}{f' ({status.detail})' if status.detail else ''}"


def _expect_done(ctx: CaseContext, rule: str, what: str, statuses: Sequence[TransferStatus], bound: float) -> None:
    bad = [s for s in statuses if s.state is not TransferState.DONE]
    if bad:
        raise ctx.fail(
            f"{rule}: {what}: {len(bad)} of {len(statuses)} transfers did not reach DONE within "
            f"{bound * ctx.time_scale:.1f} s, e.g. {_status_text(bad[0])}"
        )


# --------------------------------------------------------------------------- DONE-1: post, check, release


@case("DONE-1", "transport-post-check-release", requires=["local_pools"])
def _post_check_release(ctx: CaseContext) -> None:
    """post then check until DONE moves exactly the described bytes; check stays DONE; a released handle is gone."""
    with _pair(ctx) as pair:
        for mode in _modes(ctx):
            descriptors = _spread(pair, mode, count=7, nbytes=301)
            _fresh_source(pair, mode, descriptors, "first")
            source_before, before = _snapshot(pair.p_pool), _snapshot(pair.c_pool)
            wanted = _expected(pair, mode, descriptors, before)
            handle = pair.initiator(mode).post(mode, descriptors, peer=pair.peer(mode))
            if handle.mode is not mode or handle.peer != pair.peer(mode):
                raise ctx.fail(f"DONE-1: post({mode.value}) returned a handle for {handle.mode}/{handle.peer!r}")
            [status] = pair.wait(mode, [handle], DONE_BOUND)
            _expect_done(ctx, "DONE-1", f"{mode.value} of 7 descriptors", [status], DONE_BOUND)
            problems = [
                _diff(f"{mode.value}: destination at DONE", _snapshot(pair.c_pool), wanted),
                _diff(f"{mode.value}: source (a transfer never writes it)", _snapshot(pair.p_pool), source_before),
            ]
            again = pair.initiator(mode).check(handle)
            if again.state is not TransferState.DONE:
                problems.append(f"{mode.value}: check after DONE reported {_status_text(again)} (DONE is final)")
            pair.initiator(mode).release(handle)
            try:
                late = pair.initiator(mode).check(handle)
            except TransportError:
                pass
            else:
                problems.append(
                    f"{mode.value}: check of a released handle answered {_status_text(late)}, not TransportError"
                )
            # The same ranges again, with new source bytes: a released transfer frees nothing the next one needs.
            _fresh_source(pair, mode, descriptors, "second")
            wanted = _expected(pair, mode, descriptors, _snapshot(pair.c_pool))
            handle = pair.initiator(mode).post(mode, descriptors, peer=pair.peer(mode))
            [status] = pair.wait(mode, [handle], DONE_BOUND)
            _expect_done(ctx, "DONE-1", f"{mode.value} reposted after release", [status], DONE_BOUND)
            problems.append(_diff(f"{mode.value}: destination of the repost", _snapshot(pair.c_pool), wanted))
            pair.initiator(mode).release(handle)
            found = [p for p in problems if p]
            if found:
                raise ctx.fail("DONE-1: " + "\n".join(found))


@case("DONE-1", "transport-nothing-lands-after-done", requires=["local_pools"])
def _nothing_after_done(ctx: CaseContext) -> None:
    """Once DONE is reported no byte of the transfer lands again: the suite changes the source and watches (SETTLE)."""
    with _pair(ctx) as pair:
        posted: list[tuple[TransferMode, TransferHandle]] = []
        for index, mode in enumerate(_modes(ctx)):
            # READ and WRITE both land in the consumer's pool: disjoint halves.
            descriptors = _spread(pair, mode, count=5, nbytes=512, start=index * 16384)
            _fresh_source(pair, mode, descriptors, "done")
            handle = pair.initiator(mode).post(mode, descriptors, peer=pair.peer(mode))
            _expect_done(ctx, "DONE-1", mode.value, pair.wait(mode, [handle], DONE_BOUND), DONE_BOUND)
            _fresh_source(pair, mode, descriptors, "after-done")  # a copy that lands again now is seen
            posted.append((mode, handle))
        at_done = _snapshot(pair.c_pool)
        for mode, handle in posted:
            pair.initiator(mode).release(handle)
        pair.watch(SETTLE)
        changed = _diff("destination after DONE", _snapshot(pair.c_pool), at_done)
        if changed:
            raise ctx.fail(f"DONE-1: bytes landed after DONE, within {SETTLE * ctx.time_scale:.1f} s: {changed}")


@case("DONE-1", "transport-many-in-flight", requires=["local_pools"])
def _many_in_flight(ctx: CaseContext) -> None:
    """48 transfers posted before any is checked all reach DONE with their own bytes, each notification once."""
    notify = ctx.capabilities.notifications
    expected: dict[str, list[bytes]] = {"producer": [], "consumer": []}
    with _pair(ctx) as pair:
        for mode in _modes(ctx):
            rows = _spread(pair, mode, count=96, nbytes=200)
            _fresh_source(pair, mode, rows, "many")
            wanted = _expected(pair, mode, rows, _snapshot(pair.c_pool))
            messages = [f"many {mode.value} {i}".encode() for i in range(48)]
            initiator, peer = pair.initiator(mode), pair.peer(mode)
            handles = [
                initiator.post(mode, rows[2 * i : 2 * i + 2], peer=peer, notification=messages[i] if notify else None)
                for i in range(48)
            ]
            _expect_done(ctx, "DONE-1", f"{mode.value}, 48 in flight", pair.wait(mode, handles, DONE_BOUND), DONE_BOUND)
            changed = _diff(f"{mode.value}: destination after 48 transfers", _snapshot(pair.c_pool), wanted)
            if changed:
                raise ctx.fail(f"DONE-1: {changed}")
            for handle in handles:
                initiator.release(handle)
            if notify:
                role = "producer" if mode is TransferMode.READ else "consumer"
                expected[role] += messages
                deadline = time.monotonic() + DONE_BOUND * ctx.time_scale
                while len(pair.inbox[role]) < len(expected[role]) and time.monotonic() < deadline:
                    pair.poll()
                    time.sleep(0.0005)
        pair.watch(ECHO)  # a duplicate has this long to show up (READ's land at P, WRITE's at C: one watch)
        for role, messages in expected.items():
            got = sorted(n.message for n in pair.inbox[role])
            if got != sorted(messages):
                missing = sorted(set(messages) - set(got))
                extra = len(got) - len(set(got))
                raise ctx.fail(
                    f"DONE-1: {len(messages)} notifications posted to the {role}, {len(got)} received "
                    f"({extra} duplicates, missing {[m.decode() for m in missing[:4]]})"
                )


@case("DONE-1", "completion-implies-visibility", requires=["local_pools"])
def _completion_implies_visibility(ctx: CaseContext) -> None:
    """The moment check first says DONE, every byte of every descriptor of a 256-descriptor batch is visible.

    Mooncake's ``transfer_check_status`` reports a batch complete when its first
    task is (upstream_2026-12.md, section 8.3): the rest land later. The suite
    reads the whole destination right after the ``check`` that returned DONE,
    before any other call into either agent, two batches a mode.
    """
    with _pair(ctx, config=LARGE) as pair:
        size = pair.c_pool.regions[0].nbytes
        for index, mode in enumerate(_modes(ctx)):
            initiator, peer = pair.initiator(mode), pair.peer(mode)
            for batch in range(2):
                # READ and WRITE land in disjoint halves of the consumer's regions.
                descriptors = _spread(pair, mode, count=256, nbytes=1024, start=index * (size // 2))
                _fresh_source(pair, mode, descriptors, "visible", batch)
                wanted = _expected(pair, mode, descriptors, _snapshot(pair.c_pool))
                handle = initiator.post(mode, descriptors, peer=peer)
                status = initiator.check(handle)
                until = time.monotonic() + DONE_BOUND * ctx.time_scale
                while status.state is TransferState.PENDING and time.monotonic() < until:
                    pair.poll()
                    status = initiator.check(handle)
                at_done = _snapshot(pair.c_pool)  # nothing else runs between the DONE and this read
                _expect_done(ctx, "DONE-1", f"{mode.value} of 256 descriptors", [status], DONE_BOUND)
                missing = [
                    i for i, d in enumerate(descriptors) if _landed(at_done, mode, d) != bytes(pair.source(mode, d))
                ]
                initiator.release(handle)
                if missing:
                    raise ctx.fail(
                        f"DONE-1: {mode.value} batch {batch}: check reported DONE while {len(missing)} of "
                        f"{len(descriptors)} descriptors had not landed (first missing: descriptor {missing[0]}); "
                        "DONE must mean every byte of every descriptor is readable"
                    )
                changed = _diff(f"{mode.value} batch {batch}: destination at DONE", at_done, wanted)
                if changed:
                    raise ctx.fail(f"DONE-1: {changed}")


def _landed(snapshot: Sequence[bytes], mode: TransferMode, d: Descriptor) -> bytes:
    """The bytes a snapshot of the consumer's pool holds where ``d`` writes."""
    region, offset = (
        (d.local_region, d.local_offset) if mode is TransferMode.READ else (d.remote_region, d.remote_offset)
    )
    return snapshot[region][offset : offset + d.nbytes]


# --------------------------------------------------------------------------- DONE-1 and REL-1: notifications


@case("DONE-1", "transport-notification-after-data", requires=["local_pools", "notifications"])
def _notification_after_data(ctx: CaseContext) -> None:
    """A post's notification reaches the target once, intact, from the initiator, and only after every byte landed."""
    expected: dict[str, list[tuple[str, bytes]]] = {"producer": [], "consumer": []}
    with _pair(ctx) as pair:
        for mode in _modes(ctx):
            descriptors = _spread(pair, mode, count=24, nbytes=1000)
            _fresh_source(pair, mode, descriptors, "notified")
            wanted = _expected(pair, mode, descriptors, _snapshot(pair.c_pool))
            message = bytes(range(256)) + mode.value.encode() + b"\x00\xff"
            role = "producer" if mode is TransferMode.READ else "consumer"
            handle = pair.initiator(mode).post(mode, descriptors, peer=pair.peer(mode), notification=message)
            status = pair.initiator(mode).check(handle)
            deadline = time.monotonic() + DONE_BOUND * ctx.time_scale
            seen_at: list[bytes] | None = None
            while time.monotonic() < deadline and (seen_at is None or status.state is TransferState.PENDING):
                pair.poll()
                if seen_at is None and any(n.message == message for n in pair.inbox[role]):
                    seen_at = _snapshot(pair.c_pool)  # what the destination held when the notification arrived
                if status.state is TransferState.PENDING:
                    status = pair.initiator(mode).check(handle)
            _expect_done(ctx, "DONE-1", f"{mode.value} with a notification", [status], DONE_BOUND)
            if seen_at is None:
                raise ctx.fail(f"DONE-1: {mode.value}: the post's notification never arrived at the {role}")
            early = _diff(f"{mode.value}: destination when the notification arrived", seen_at, wanted)
            if early:
                raise ctx.fail(f"DONE-1: the notification came before the data: {early}")
            pair.initiator(mode).release(handle)
            expected[role] = [(pair.initiator(mode).name, message)]
        pair.watch(ECHO)  # READ's notification lands at P, WRITE's at C: one watch sees a duplicate of either
        for role, wanted_notes in expected.items():
            got = [(n.peer, n.message) for n in pair.inbox[role]]
            if got != wanted_notes:
                raise ctx.fail(
                    f"DONE-1: the {role} expected {[(p, len(m)) for p, m in wanted_notes]} (sender, bytes), "
                    f"once and intact; got {[(p, len(m), (p, m) in wanted_notes) for p, m in got]}"
                )


@case("REL-1", "transport-notifications-exactly-once", requires=["local_pools", "notifications"])
def _notifications_once(ctx: CaseContext) -> None:
    """send_notification delivers each message exactly once, intact and in order, to the peer alone, both ways."""
    with _pair(ctx) as pair:
        to_producer = [b"c%d|" % i + bytes(range(i, 256)) for i in range(24)]
        to_consumer = [b"p%d|" % i + bytes(i) for i in range(24)]
        for i in range(24):
            pair.consumer.send_notification(pair.producer_name, to_producer[i])
            pair.producer.send_notification(pair.consumer_name, to_consumer[i])
        deadline = time.monotonic() + DONE_BOUND * ctx.time_scale
        while time.monotonic() < deadline and (len(pair.inbox["producer"]) < 24 or len(pair.inbox["consumer"]) < 24):
            pair.poll()
            time.sleep(0.0005)
        pair.watch(ECHO)
        for role, sent, sender in (
            ("producer", to_producer, pair.consumer.name),
            ("consumer", to_consumer, pair.producer.name),
        ):
            got = pair.inbox[role]
            if [n.message for n in got] != sent or {n.peer for n in got} != {sender}:
                raise ctx.fail(
                    f"REL-1: {len(sent)} notifications sent to the {role}, {len(got)} received; "
                    f"in order and intact: {[n.message for n in got] == sent}; senders {sorted({n.peer for n in got})}"
                )


# --------------------------------------------------------------------------- PLAN-1: descriptor bounds


def _bad_descriptors(pair: _Pair) -> list[tuple[str, Descriptor]]:
    size = pair.c_pool.regions[0].nbytes
    regions = len(pair.c_pool.regions)
    ok = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=64)
    return [
        ("one byte past the local region", attrs.evolve(ok, local_offset=size - 63)),
        ("one byte past the remote region", attrs.evolve(ok, remote_offset=size - 63)),
        ("starting at the local region's end", attrs.evolve(ok, local_offset=size, nbytes=1)),
        ("starting at the remote region's end", attrs.evolve(ok, remote_offset=size, nbytes=1)),
        ("an unregistered local region", attrs.evolve(ok, local_region=regions)),
        ("an unregistered remote region", attrs.evolve(ok, remote_region=regions)),
        ("a negative local region", attrs.evolve(ok, local_region=-1)),
        ("a negative remote region", attrs.evolve(ok, remote_region=-1)),
        ("a negative local offset", attrs.evolve(ok, local_offset=-1)),
        ("a negative remote offset", attrs.evolve(ok, remote_offset=-64)),
        ("zero bytes", attrs.evolve(ok, nbytes=0)),
        ("a negative size", attrs.evolve(ok, local_offset=64, remote_offset=64, nbytes=-64)),
    ]


@case("PLAN-1", "transport-descriptor-bounds", requires=["local_pools"])
def _descriptor_bounds(ctx: CaseContext) -> None:
    """Descriptors ending on a region's last byte move; past it, unregistered, empty or negative are refused whole.

    Each bad descriptor is posted alone and after a valid one; post must raise
    PlanError before any byte moves, on either side, and nothing is clamped.
    """
    with _pair(ctx) as pair:
        size = pair.c_pool.regions[1].nbytes
        for mode in _modes(ctx):
            initiator, peer = pair.initiator(mode), pair.peer(mode)
            # The last byte of a region, on both sides, is inside it.
            edge = [
                Descriptor(local_region=1, local_offset=size - 97, remote_region=1, remote_offset=size - 97, nbytes=97),
                Descriptor(local_region=0, local_offset=size - 31, remote_region=1, remote_offset=0, nbytes=31),
            ]
            _fresh_source(pair, mode, edge, "edge")
            wanted = _expected(pair, mode, edge, _snapshot(pair.c_pool))
            try:
                handle = initiator.post(mode, edge, peer=peer)
            except PlanError as exc:
                raise ctx.fail(
                    f"PLAN-1: {mode.value}: descriptors ending on a region's last byte refused: {exc}"
                ) from exc
            _expect_done(
                ctx, "PLAN-1", f"{mode.value} up to the last byte", pair.wait(mode, [handle], DONE_BOUND), DONE_BOUND
            )
            initiator.release(handle)
            changed = _diff(f"{mode.value}: destination ending on the last byte", _snapshot(pair.c_pool), wanted)
            if changed:
                raise ctx.fail(f"PLAN-1: {changed}")
            good = Descriptor(local_region=0, local_offset=128, remote_region=0, remote_offset=4096, nbytes=256)
            problems = []
            for name, bad in _bad_descriptors(pair):
                for label, rows in ((name, [bad]), (f"{name}, after a valid one", [good, bad])):
                    p_before, c_before = _snapshot(pair.p_pool), _snapshot(pair.c_pool)
                    try:
                        handle = initiator.post(mode, rows, peer=peer)
                    except PlanError:
                        pass
                    except KVSpecError as exc:
                        problems.append(f"{mode.value}, {label}: expected PlanError, got {type(exc).__name__}: {exc}")
                    else:
                        status = pair.wait(mode, [handle], DONE_BOUND)[0]
                        initiator.release(handle)
                        problems.append(f"{mode.value}, {label}: posted (then {_status_text(status)}), not refused")
                    pair.poll()
                    for what, pool, before in (
                        ("producer", pair.p_pool, p_before),
                        ("consumer", pair.c_pool, c_before),
                    ):
                        moved = _diff(f"{mode.value}, {label}: {what} memory", _snapshot(pool), before)
                        if moved:
                            problems.append(moved + " (a refused post moved bytes)")
            if problems:
                raise ctx.fail("PLAN-1: " + "\n".join(problems))


# --------------------------------------------------------------------------- SM-2: release of a pending transfer


def _release_pending(ctx: CaseContext, *, wait_first: float) -> None:
    """Post a large transfer per mode, see it PENDING, release it; after ``wait_first`` (scaled) no byte may change.

    READ moves region 0 and WRITE region 1 of each side, so both modes are watched in one settle period.
    """
    ctx.expect_error_logs()  # a lost peer, a cancel or an injected fault may be logged as an error
    with _pair(ctx, config=LARGE) as pair:
        size = pair.c_pool.regions[0].nbytes
        released: list[tuple[TransferMode, list[Descriptor]]] = []
        for region, mode in enumerate(_modes(ctx)):
            rows = [
                Descriptor(
                    local_region=region, local_offset=o, remote_region=region, remote_offset=o, nbytes=size // 64
                )
                for o in range(0, size, size // 64)
            ]
            _fresh_source(pair, mode, rows, "cancel")
            initiator = pair.initiator(mode)
            handle = initiator.post(mode, rows, peer=pair.peer(mode))
            status = initiator.check(handle)
            if status.state is not TransferState.PENDING:
                raise ctx.fail(
                    f"SM-2: {mode.value}: a 1 MiB transfer was {_status_text(status)} at its first check; "
                    "a backend declaring observable_in_flight must show it PENDING"
                )
            initiator.release(handle)
            released.append((mode, rows))
        pair.watch(wait_first)
        settled = _snapshot(pair.c_pool)
        for mode, rows in released:
            _fresh_source(pair, mode, rows, "after-release")  # a copy still running now carries new bytes
        pair.watch(SETTLE)
        changed = _diff("destination after release", _snapshot(pair.c_pool), settled)
        if changed:
            when = (
                "right after release returned"
                if not wait_first
                else f"{wait_first * ctx.time_scale:.1f} s after release"
            )
            modes = ", ".join(m.value for m, _ in released)
            raise ctx.fail(
                f"SM-2: bytes landed after the transfer was released ({modes}; watched from {when}): {changed}"
            )


@case("SM-2", "transport-release-pending", requires=["local_pools", "observable_in_flight"])
def _release_pending_case(ctx: CaseContext) -> None:
    """No byte of a released PENDING transfer lands after release returns (immediate_cancel), or after DRAIN.

    A backend declaring ``immediate_cancel`` is watched from the moment
    ``release`` returns; any other from the drain bound (1 s, scaled) on.
    """
    _release_pending(ctx, wait_first=0.0 if ctx.capabilities.immediate_cancel else DRAIN)


# --------------------------------------------------------------------------- FAIL-1: the peer goes away


_LOSSES: dict[str, Callable[[_Pair, TransferMode], None]] = {
    "the initiator removes its peer": lambda pair, mode: pair.initiator(mode).remove_remote_agent(pair.peer(mode)),
    "the target closes": lambda pair, mode: pair.target(mode).close(),
    "the target removes the initiator": lambda pair, mode: pair.target(mode).remove_remote_agent(
        pair.consumer_name if mode is TransferMode.READ else pair.producer_name
    ),
}


@case("FAIL-1", "transport-peer-loss", requires=["local_pools", "observable_in_flight"])
def _peer_loss(ctx: CaseContext) -> None:
    """A peer removed or closed mid-transfer: check reports FAILED(peer_disconnected) within LOSS_BOUND, never PENDING.

    When the initiator removes its peer, or the target closes, the transfer
    fails with ``peer_disconnected`` exactly (the initiator knows why: a timeout
    is wrong here). When the target only forgets the initiator, the transfer
    may still complete, with every byte, or fail the same way. Either way a
    later post to a removed peer, or a call on a closed agent, raises
    TransportError.
    """
    ctx.expect_error_logs()  # a lost peer, a cancel or an injected fault may be logged as an error
    problems: list[str] = []
    bound = LOSS_BOUND * ctx.time_scale
    for mode in _modes(ctx):
        for event, lose in _LOSSES.items():
            with _pair(ctx, config=LARGE) as pair:
                size = pair.c_pool.regions[0].nbytes
                rows = [
                    Descriptor(local_region=r, local_offset=o, remote_region=r, remote_offset=o, nbytes=size // 32)
                    for r in range(2)
                    for o in range(0, size, size // 32)
                ]
                _fresh_source(pair, mode, rows, "loss")
                wanted = _expected(pair, mode, rows, _snapshot(pair.c_pool))
                initiator = pair.initiator(mode)
                handle = initiator.post(mode, rows, peer=pair.peer(mode))
                lose(pair, mode)
                started = time.monotonic()
                [status] = pair.wait(mode, [handle], LOSS_BOUND)
                took = time.monotonic() - started
                label = f"{mode.value}, {event}"
                if status.state is TransferState.PENDING:
                    problems.append(f"{label}: still PENDING {took:.1f} s later (a lost peer must be reported)")
                elif status.state is TransferState.FAILED and status.reason is not FailureReason.PEER_DISCONNECTED:
                    problems.append(f"{label}: {_status_text(status)}, expected FAILED peer_disconnected")
                elif status.state is TransferState.DONE:
                    if event != "the target removes the initiator":
                        problems.append(f"{label}: reported DONE after its peer was lost before any check")
                    elif _diff("", _snapshot(pair.c_pool), wanted):
                        problems.append(f"{label}: DONE with bytes missing (DONE-1)")
                initiator.release(handle)
                if event == "the initiator removes its peer":
                    try:
                        initiator.post(mode, rows[:1], peer=pair.peer(mode))
                    except TransportError:
                        pass
                    else:
                        problems.append(f"{label}: a post to the removed peer was accepted")
                elif event == "the target removes the initiator":
                    gone = pair.consumer_name if mode is TransferMode.READ else pair.producer_name
                    try:
                        pair.target(mode).send_notification(gone, b"to a forgotten peer")
                    except TransportError:
                        pass
                    else:
                        problems.append(f"{label}: send_notification to the removed peer was accepted")
    for mode in _modes(ctx):
        with _pair(ctx) as pair:
            initiator = pair.initiator(mode)
            handle = initiator.post(mode, _spread(pair, mode, count=4, nbytes=256), peer=pair.peer(mode))
            initiator.close()
            try:
                initiator.check(handle)
            except TransportError:
                pass
            else:
                problems.append(
                    f"{mode.value}, the initiator closes: check on the closed agent answered, not TransportError"
                )
            pair.poll()  # the target goes on working
            if not isinstance(pair.target(mode).get_notifications(), Sequence):
                problems.append(f"{mode.value}, the initiator closes: the target's get_notifications broke")
    if problems:
        raise ctx.fail(f"FAIL-1: (bound {bound:.1f} s)\n" + "\n".join(problems))


@case("INT-1", "transport-integrity", requires=["local_pools", "integrity"])
def _integrity(ctx: CaseContext) -> None:
    """A corrupted transfer is caught: by the backend's own check, or else by the INT-1 digests over its bytes."""
    ctx.expect_error_logs()  # a lost peer, a cancel or an injected fault may be logged as an error
    if ctx.backend.capabilities.integrity:
        _native_integrity(ctx)
        return
    # The drivers' INT-1: the sender's digests against the digests of the bytes this backend delivered.
    pairs = BlockPairs(
        producer_block_ids=BlockIds([[3, 4, 5, 9], [11, 12]]), consumer_block_ids=BlockIds([[20, 7, 8, 30], [2, 40]])
    )
    plan = plan_transfer(producer_config=CONFIG, consumer_config=CONFIG, pairs=pairs)
    for label, backend in (
        ("intact", ctx.backend),
        ("corrupted", FaultyBackend(ctx.backend, FaultPlan(corrupt_page=1.0))),
    ):
        with _pair(ctx, backend=backend) as pair:
            sender = PageDigester(CONFIG, [r.buffer for r in pair.p_pool.regions])
            receiver = PageDigester(CONFIG, [r.buffer for r in pair.c_pool.regions])
            for mode in _modes(ctx):
                for g, ids in enumerate(pairs.producer_block_ids):
                    for block_id in ids:
                        for layer in CONFIG.kv_cache_groups[g].layer_names:
                            region, offset = CONFIG.page_offset(layer, block_id)
                            page = CONFIG.kv_cache_groups[g].kv_cache_spec.page_size_bytes
                            pair.p_pool.regions[region].buffer[offset : offset + page] = _noise(
                                page, "int", label, mode.value, g, block_id, layer
                            )
                handle = pair.initiator(mode).post(mode, plan.to_descriptors(mode), peer=pair.peer(mode))
                [status] = pair.wait(mode, [handle], DONE_BOUND)
                pair.initiator(mode).release(handle)
                if status.state is not TransferState.DONE:
                    raise ctx.fail(f"INT-1: {mode.value}, {label}: the transfer ended {_status_text(status)}, not DONE")
                if mode is TransferMode.READ:
                    sent = sender.digests(pairs.producer_block_ids)
                    bad = receiver.check_read(pairs, pairs.producer_block_ids, sent)
                else:
                    bad = receiver.check_written(
                        pairs.consumer_block_ids, sender.written_digests(pairs, pairs.consumer_block_ids)
                    )
                found = sorted(b for group in bad for b in group)
                if label == "intact" and found:
                    raise ctx.fail(f"INT-1: {mode.value}: an intact transfer failed the digests of blocks {found}")
                if label == "corrupted" and not found:
                    raise ctx.fail(f"INT-1: {mode.value}: a corrupted transfer passed the digests of every block")


def _native_integrity(ctx: CaseContext) -> None:
    corrupting = FaultyBackend(ctx.backend, FaultPlan(corrupt_page=1.0))
    with _pair(ctx, backend=corrupting) as pair:
        for mode in _modes(ctx):
            descriptors = _spread(pair, mode, count=4, nbytes=512)
            _fresh_source(pair, mode, descriptors, "corrupt")
            handle = pair.initiator(mode).post(mode, descriptors, peer=pair.peer(mode))
            [status] = pair.wait(mode, [handle], DONE_BOUND)
            pair.initiator(mode).release(handle)
            if status.state is not TransferState.FAILED or status.reason is not FailureReason.INTEGRITY:
                raise ctx.fail(
                    f"INT-1: {mode.value}: a corrupted transfer ended {_status_text(status)}, expected FAILED integrity"
                )


# --------------------------------------------------------------------------- cross_process: live shared memory


@case("DONE-1", "transport-live-shared-memory", requires=["local_pools", "cross_process"])
def _live_memory(ctx: CaseContext) -> None:
    """Agents in other processes see the suite's writes to registered memory, and the suite sees theirs, every time."""
    with _pair(ctx) as pair:
        if not all(r.shm_name for r in (*pair.p_pool.regions, *pair.c_pool.regions)):
            raise ctx.fail("DONE-1: the suite's pools are not in shared memory")
        for mode in _modes(ctx):
            descriptors = _spread(pair, mode, count=3, nbytes=777)
            for round_ in range(3):
                _fresh_source(pair, mode, descriptors, "live", round_)
                wanted = _expected(pair, mode, descriptors, _snapshot(pair.c_pool))
                handle = pair.initiator(mode).post(mode, descriptors, peer=pair.peer(mode))
                _expect_done(
                    ctx, "DONE-1", f"{mode.value} round {round_}", pair.wait(mode, [handle], DONE_BOUND), DONE_BOUND
                )
                pair.initiator(mode).release(handle)
                stale = _diff(f"{mode.value} round {round_}: destination", _snapshot(pair.c_pool), wanted)
                if stale:
                    raise ctx.fail(f"DONE-1: bytes written after registration did not travel: {stale}")


# --------------------------------------------------------------------------- FAIL-1: where the peer dies, at what pace


# Where the target dies: right after both loaded each other's metadata (nothing moved yet, a cold pair); before
# the next post of a pair that already moved a transfer (warm: connections up); after a post.
_DEATHS = ("after metadata load", "before post", "after post")


def _progress_modes(ctx: CaseContext) -> list[tuple[str, Backend]]:
    """The backend as given, and under each sound pace when its agents are in this process (cheap to make)."""
    modes: list[tuple[str, Backend]] = [("as given", ctx.backend)]
    if not isinstance(ctx.backend, PacedBackend) and not ctx.capabilities.cross_process:
        modes += [(f"pace {name}", PacedBackend(ctx.backend, Pace.named(name, seed=0))) for name in PACES]
    return modes


def _die(ctx: CaseContext, backend: Backend, mode: TransferMode, death: str) -> str | None:
    """The target dies at ``death``; what went wrong, or None. Every call the initiator makes is timed."""
    bound = LOSS_BOUND * ctx.time_scale
    calls: dict[str, float] = {}

    def timed(what: str, call: Callable[[], object]) -> object:
        started = time.monotonic()
        try:
            return call()
        finally:
            calls[what] = time.monotonic() - started

    with _pair(ctx, backend=backend) as pair:
        initiator, target, peer = pair.initiator(mode), pair.target(mode), pair.peer(mode)
        rows = _spread(pair, mode, count=8, nbytes=2048)
        if death == "before post":
            warm = initiator.post(mode, rows[:1], peer=peer)
            _expect_done(
                ctx, "FAIL-1", f"{mode.value} before the peer dies", pair.wait(mode, [warm], DONE_BOUND), DONE_BOUND
            )
            initiator.release(warm)
        _fresh_source(pair, mode, rows, "die", death)
        wanted = _expected(pair, mode, rows, _snapshot(pair.c_pool))
        before = _snapshot(pair.c_pool)
        handle: TransferHandle | None = None
        if death == "after post":
            handle = initiator.post(mode, rows, peer=peer)
        target.close()
        status: TransferStatus | None = None
        try:
            if handle is None:
                handle = cast(TransferHandle, timed("post", lambda: initiator.post(mode, rows, peer=peer)))
        except TransportError:
            pass  # refused: the cleanest outcome when the peer is known dead
        else:
            started = time.monotonic()
            [status] = pair.wait(mode, [handle], LOSS_BOUND)
            calls["wait"] = time.monotonic() - started
            timed("release", lambda: initiator.release(handle))
        timed("close", initiator.close)
        slow = [f"{what} took {took:.1f} s" for what, took in calls.items() if what != "wait" and took > bound]
        if slow:
            return ", ".join(slow) + f" (nothing may hang: bound {bound:.1f} s)"
        if status is None:
            moved = _diff("destination after a refused post", _snapshot(pair.c_pool), before)
            return None if moved is None else moved + " (a refused post moved bytes)"
        if status.state is TransferState.PENDING:
            return f"still PENDING {calls['wait']:.1f} s after the peer died (a dead peer must be reported)"
        if status.state is TransferState.FAILED:
            return None if status.reason is not None else "FAILED without a typed reason"
        if death != "after post":
            return "DONE, though the peer died before the transfer was posted"
        return _diff("DONE after the peer died: destination", _snapshot(pair.c_pool), wanted)


@case("FAIL-1", "transport-peer-dies-matrix", requires=["local_pools"])
def _peer_dies_matrix(ctx: CaseContext) -> None:
    """The target dies after metadata load, before post or after post, at each pace: refused, FAILED or whole DONE.

    After metadata load: both agents loaded each other's metadata and nothing
    moved yet; before post: one transfer already moved, so connections are up,
    and the next is posted after the death. Before a post, the post is refused (TransportError) or the transfer ends
    FAILED with a reason; after a post, FAILED or DONE are both allowed, and
    DONE needs every byte. Nothing may stay PENDING past LOSS_BOUND (scaled),
    and a refused post moves no byte. Paces (kvspec.transport.pace) stand for
    the progress modes: a caller that checks rarely, or completions that come
    late; agents in other processes run as given only (each pair costs two
    processes).
    """
    ctx.expect_error_logs()  # a lost peer, a cancel or an injected fault may be logged as an error
    for progress, backend in _progress_modes(ctx):
        for mode in _modes(ctx):
            for death in _DEATHS:
                found = _die(ctx, backend, mode, death)
                if found:
                    # One is enough: a backend deaf to a dead peer would wait out LOSS_BOUND at every point.
                    raise ctx.fail(f"FAIL-1: {mode.value}, {progress}, the target dies {death}: {found}")


# --------------------------------------------------------------------------- FAIL-1: a registration that fails


@case("FAIL-1", "transport-registration-failure", requires=["local_pools"])
def _registration_failure(ctx: CaseContext) -> None:
    """An agent whose memory registration failed moves no byte from or into that memory; a new agent works.

    The injector's ``fail_registration`` makes the consumer's
    ``register_memory`` raise without registering anything. Posts that name
    the consumer's regions, a READ from its side or a WRITE into it, must be
    refused (PlanError or TransportError) or end FAILED, with no byte of
    either pool changed; closing both agents returns; a fresh pair then moves
    every byte.
    """
    ctx.expect_error_logs()  # a lost peer, a cancel or an injected fault may be logged as an error
    failing = FaultyBackend(ctx.backend, FaultPlan(fail_registration=True, agents=["consumer"]))
    problems: list[str] = []
    with allocate_pool(CONFIG) as p_pool, allocate_pool(CONFIG) as c_pool:
        for pool, side in ((p_pool, "producer"), (c_pool, "consumer")):
            for index, region in enumerate(pool.regions):
                region.buffer[:] = _noise(region.nbytes, "background", side, index)
        producer = failing.create_agent("producer")
        consumer = failing.create_agent("consumer")
        try:
            producer.register_memory(p_pool.regions)
            with contextlib.suppress(TransportError):
                consumer.register_memory(c_pool.regions)
            pair = _Pair(
                ctx=ctx,
                producer=producer,
                consumer=consumer,
                p_pool=p_pool,
                c_pool=c_pool,
                producer_name="",
                consumer_name="",
            )
            try:
                pair.producer_name = consumer.add_remote_agent(producer.get_agent_metadata())
                pair.consumer_name = producer.add_remote_agent(consumer.get_agent_metadata())
            except TransportError:
                pass  # refusing the metadata of an agent with no memory is clean too
            else:
                for mode in _modes(ctx):
                    rows = _spread(pair, mode, count=4, nbytes=512)
                    _fresh_source(pair, mode, rows, "unregistered")
                    before = (_snapshot(p_pool), _snapshot(c_pool))
                    try:
                        handle = pair.initiator(mode).post(mode, rows, peer=pair.peer(mode))
                    except (PlanError, TransportError):
                        pass
                    else:
                        [status] = pair.wait(mode, [handle], DONE_BOUND)
                        pair.initiator(mode).release(handle)
                        if status.state is not TransferState.FAILED:
                            problems.append(
                                f"{mode.value} naming the unregistered memory: {_status_text(status)}, "
                                "expected a refused post or FAILED"
                            )
                    pair.poll()
                    for what, pool, was in (("producer", p_pool, before[0]), ("consumer", c_pool, before[1])):
                        moved = _diff(f"{mode.value}: {what} memory", _snapshot(pool), was)
                        if moved:
                            problems.append(moved + " (memory whose registration failed took part in a transfer)")
        finally:
            for agent in (consumer, producer):
                with contextlib.suppress(KVSpecError):
                    agent.close()
    if not any(f.kind == "fail_registration" for f in failing.injected):
        problems.append("the injected registration failure did not fire")
    with _pair(ctx) as pair:
        for mode in _modes(ctx):
            rows = _spread(pair, mode, count=4, nbytes=512)
            _fresh_source(pair, mode, rows, "after-failed-registration")
            wanted = _expected(pair, mode, rows, _snapshot(pair.c_pool))
            handle = pair.initiator(mode).post(mode, rows, peer=pair.peer(mode))
            _expect_done(
                ctx, "FAIL-1", f"{mode.value} by a new pair", pair.wait(mode, [handle], DONE_BOUND), DONE_BOUND
            )
            pair.initiator(mode).release(handle)
            changed = _diff(f"{mode.value}: a new pair after a failed registration", _snapshot(pair.c_pool), wanted)
            if changed:
                problems.append(changed)
    if problems:
        raise ctx.fail("FAIL-1: " + "\n".join(problems))
