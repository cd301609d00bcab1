"""A deterministic fault injector around any Transport or Backend (FAIL-1, DONE-1)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, KVSpecError, TransportError
from kvspec.transport._base import (
    Backend,
    Capabilities,
    Descriptor,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
)

__all__ = ["FaultInjector", "FaultPlan", "FaultyBackend", "InjectedFault"]


def _probability(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"FaultPlan.{attribute.name}: expected a probability in [0, 1], got {value!r}")


def _duration(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 600.0:
        raise ConfigError(f"FaultPlan.{attribute.name}: expected seconds in [0, 600], got {value!r}")


# Marks a FaultPlan field that is a time: FaultPlan.scaled (--time-scale) multiplies it.
_SECONDS = {"seconds": True}


def _non_negative(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None and attribute.name == "disconnect_at_post":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"FaultPlan.{attribute.name}: expected a non-negative int, got {value!r}")


def _seconds(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 60.0:
        raise ConfigError(f"FaultPlan.{attribute.name}: expected seconds in [0, 60], got {value!r}")


def _flag(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"FaultPlan.{attribute.name}: expected True or False, got {value!r}")


def _to_names(value: str | Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset({value})
    return frozenset(value)


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Which faults to inject, how often, and with which seed; the same plan replays the same faults.

    Probabilities apply per event: per received notification (``drop``,
    ``duplicate``, ``delay``, ``reorder``) or per post (``fail_post``,
    ``partial_transfer``, ``corrupt_page``). A delayed notification is held
    for ``delay_polls`` calls **and** ``delay_seconds`` of wall time; the
    seconds, as every time in the plan, follow ``--time-scale``
    (:meth:`scaled`), polls do not. ``skip_posts`` posts pass
    untouched before post faults may fire. ``disconnect_at_post=k`` cuts every
    peer off once the k-th post is made (0: before any post): transfers in
    flight then fail with ``peer_disconnected``, later posts and sends raise
    :class:`kvspec.TransportError`, and the peer's notifications are lost until
    it is added again. ``agents`` limits the faults to agents of those names.

    Three faults the most trusted transfer engines' own tests inject as well:
    ``flip_status`` (per post) reports a transfer that completed, every byte
    landed and its notification sent, as ``FAILED(transfer_error)``: the
    caller must end it FAILED, never LOADED (FAIL-1). ``post_latency`` holds
    every post back that many seconds before it reaches the inner agent: the
    transfer is PENDING meanwhile and moves no byte, as with an engine whose
    post is slow to start (DONE-1). ``fail_registration`` makes
    ``register_memory`` raise :class:`kvspec.TransportError` without
    registering anything: the agent has no memory, and posts from or into it
    must be refused (FAIL-1).
    """

    seed: int = 0
    drop_notifications: float = attrs.field(default=0.0, validator=_probability)
    duplicate_notifications: float = attrs.field(default=0.0, validator=_probability)
    delay_notifications: float = attrs.field(default=0.0, validator=_probability)
    reorder_notifications: float = attrs.field(default=0.0, validator=_probability)
    delay_polls: int = attrs.field(default=3, validator=_non_negative)
    delay_seconds: float = attrs.field(default=0.0, validator=_duration, metadata=_SECONDS)
    fail_post: float = attrs.field(default=0.0, validator=_probability)
    partial_transfer: float = attrs.field(default=0.0, validator=_probability)
    corrupt_page: float = attrs.field(default=0.0, validator=_probability)
    skip_posts: int = attrs.field(default=0, validator=_non_negative)
    disconnect_at_post: int | None = attrs.field(default=None, validator=_non_negative)
    agents: frozenset[str] | None = attrs.field(default=None, converter=_to_names)
    flip_status: float = attrs.field(default=0.0, validator=_probability)
    post_latency: float = attrs.field(default=0.0, validator=_seconds, metadata=_SECONDS)
    fail_registration: bool = attrs.field(default=False, validator=_flag)

    def applies_to(self, agent_name: str) -> bool:
        """Whether this plan injects faults into the agent named ``agent_name``."""
        return self.agents is None or agent_name in self.agents

    def scaled(self, factor: float) -> FaultPlan:
        """This plan with every time (each field marked ``_SECONDS``) multiplied by ``factor`` (``--time-scale``)."""
        times = {f.name: getattr(self, f.name) * factor for f in attrs.fields(FaultPlan) if f.metadata.get("seconds")}
        return attrs.evolve(self, **times)


@attrs.frozen(kw_only=True)
class InjectedFault:
    """One fault that fired, for reports and reproducers."""

    agent: str
    kind: str
    detail: str


@attrs.define(eq=False)
class _Posted:
    """What the injector remembers about one posted transfer."""

    inner: TransferHandle
    peer: str
    fault: str | None = None
    # READ corruption flips a byte in the local destination once the data landed.
    corrupt_at: tuple[int, int] | None = None
    inner_released: bool = False
    final: TransferStatus | None = None
    # post_latency: the inner agent's handle, once the held post reached it (``inner`` is then the caller's).
    issued: TransferHandle | None = None
    # post_latency: the post reaches the inner agent at ``issue_at`` (monotonic); until then ``held`` keeps it.
    issue_at: float = 0.0
    held: tuple[TransferMode, list[Descriptor], bytes | None] | None = None


@attrs.define(eq=False)
class _Held:
    notification: Notification
    polls_left: int
    behind_next: bool = False
    # A delayed notification also waits until then (time.monotonic(), FaultPlan.delay_seconds).
    due_time: float = 0.0


def _first_bytes(descriptors: Sequence[Descriptor], nbytes: int) -> list[Descriptor]:
    """The descriptors that move the first ``nbytes`` bytes, the last one cut short."""
    kept: list[Descriptor] = []
    for d in descriptors:
        if nbytes <= 0:
            break
        kept.append(d if d.nbytes <= nbytes else attrs.evolve(d, nbytes=nbytes))
        nbytes -= d.nbytes
    return kept


class FaultInjector:
    """Wraps any :class:`Transport` and injects the faults of a :class:`FaultPlan`.

    Notification faults act on what this agent receives; post faults on what
    it posts. A transfer reported FAILED by the injector has no bytes still in
    flight: a partial transfer is reported only after its moved part is DONE,
    and a disconnect releases (cancels) the inner transfer first, so a caller
    that frees blocks on FAILED never races a late write (SM-2).
    """

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        if not isinstance(plan, FaultPlan):
            raise ConfigError(f"FaultInjector.plan: expected a FaultPlan, got {plan!r}")
        self._inner = inner
        self._plan = plan
        self._active = plan.applies_to(inner.name)
        self._rng = random.Random(f"{plan.seed}:{inner.name}")
        # The status flip draws from its own sequence, so plans without it replay the faults they always did.
        self._flip_rng = random.Random(f"{plan.seed}:{inner.name}:flip")
        self._regions: list[memoryview] = []
        self._posted: dict[int, _Posted] = {}
        self._posts = 0
        self._disconnected: set[str] = set()
        self._all_disconnected = False
        self._held: list[_Held] = []
        self._injected: list[InjectedFault] = []
        # disconnect_at_post=0: the link drops before the first post or send, after the handshake.
        self._disconnect_pending = self._active and plan.disconnect_at_post == 0

    # -- introspection

    @property
    def inner(self) -> Transport:
        """The wrapped transport."""
        return self._inner

    @property
    def plan(self) -> FaultPlan:
        """The plan this injector follows."""
        return self._plan

    @property
    def injected(self) -> tuple[InjectedFault, ...]:
        """Every fault fired so far, in order."""
        return tuple(self._injected)

    def _record(self, kind: str, detail: str) -> None:
        self._injected.append(InjectedFault(agent=self._inner.name, kind=kind, detail=detail))

    def _roll(self, probability: float) -> bool:
        # Always draw, so that one fault's probability does not shift another's sequence.
        draw = self._rng.random()
        return self._active and draw < probability

    def _is_disconnected(self, peer: str) -> bool:
        return self._all_disconnected or peer in self._disconnected

    def _refuse_if_disconnected(self, peer: str) -> None:
        if self._disconnect_pending:
            self._disconnect_pending = False
            self._disconnect_all()
        if self._is_disconnected(peer):
            raise TransportError(
                f"fault injector: peer {peer!r} disconnected", reason=FailureReason.PEER_DISCONNECTED.value
            )

    # -- Transport

    @property
    def name(self) -> str:
        """The wrapped agent's name."""
        return self._inner.name

    @property
    def capabilities(self) -> Capabilities:
        """The wrapped agent's capabilities."""
        return self._inner.capabilities

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register through the inner agent; keep views for READ corruption. ``fail_registration``: refuse."""
        if self._active and self._plan.fail_registration:
            self._record("fail_registration", f"{len(regions)} regions, none registered")
            raise TransportError(
                f"fault injector: registration of {len(regions)} regions failed", reason=FailureReason.POST_FAILED.value
            )
        self._inner.register_memory(regions)
        for region in regions:
            view = region.buffer
            self._regions.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)

    def get_agent_metadata(self) -> bytes:
        """The inner agent's metadata."""
        return self._inner.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Add a peer; a peer cut off by a disconnect is reachable again (re-handshake)."""
        peer = self._inner.add_remote_agent(metadata)
        self._disconnected.discard(peer)
        if self._all_disconnected:
            self._all_disconnected = False
        return peer

    def remove_remote_agent(self, peer: str) -> None:
        """Forget a peer."""
        self._inner.remove_remote_agent(peer)

    def _disconnect_all(self) -> None:
        self._all_disconnected = True
        self._record("disconnect", f"after {self._posts} posts")

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Post through the inner agent, unless a post fault fires."""
        self._refuse_if_disconnected(peer)
        self._posts += 1
        eligible = self._posts > self._plan.skip_posts
        fail, partial, corrupt = (self._roll(p) for p in self._fault_probabilities(eligible))
        if fail:
            self._record("fail_post", f"post {self._posts} to {peer!r}")
            raise TransportError(f"fault injector: post {self._posts} failed", reason=FailureReason.POST_FAILED.value)
        descriptors = list(descriptors)
        state = _Posted(inner=TransferHandle(transfer_id=0, peer=peer, mode=mode), peer=peer)
        if partial:
            total = sum(d.nbytes for d in descriptors)
            descriptors = _first_bytes(descriptors, total // 2)
            self._record("partial_transfer", f"post {self._posts}: {total // 2} of {total} bytes")
            # The notification rides on the complete transfer only; a partial one never sends it.
            notification, state.fault = None, "partial"
        elif corrupt and descriptors:
            state.fault = "corrupt"
            descriptors = self._corrupt(mode, descriptors, state)
        flip = self._flip_rng.random() < self._plan.flip_status and self._active and eligible
        if flip and state.fault is None:
            state.fault = "flip"
        if self._active and self._plan.post_latency > 0:
            # The caller gets a handle now; the inner agent sees the post once the latency passed.
            # A handle of its own (a negative id) until then; the inner agent's comes with the post.
            state.inner = TransferHandle(transfer_id=-self._posts, peer=peer, mode=mode)
            state.held = (mode, descriptors, notification)
            state.issue_at = time.monotonic() + self._plan.post_latency
            self._record("post_latency", f"post {self._posts}: {self._plan.post_latency:.3f} s")
        else:
            state.inner = self._inner.post(mode, descriptors, peer=peer, notification=notification)
        self._posted[id(state.inner)] = state
        if self._active and self._plan.disconnect_at_post == self._posts:
            self._disconnect_all()
        return state.inner

    def _fault_probabilities(self, eligible: bool) -> tuple[float, float, float]:
        if not eligible:
            return (0.0, 0.0, 0.0)
        return (self._plan.fail_post, self._plan.partial_transfer, self._plan.corrupt_page)

    def _corrupt(self, mode: TransferMode, descriptors: list[Descriptor], state: _Posted) -> list[Descriptor]:
        first = descriptors[0]
        if mode is TransferMode.READ:
            # The destination is local: flip one byte once the data landed.
            state.corrupt_at = (first.local_region, first.local_offset + first.nbytes // 2)
            self._record(
                "corrupt_page", f"post {self._posts}: local region {first.local_region} byte {state.corrupt_at[1]}"
            )
            return descriptors
        # WRITE: the destination is the peer's; read the first copy from a neighbouring range instead.
        size = self._regions[first.local_region].nbytes if first.local_region < len(self._regions) else 0
        shifted = first.local_offset + first.nbytes
        if shifted + first.nbytes > size:
            shifted = max(0, first.local_offset - first.nbytes)
        self._record("corrupt_page", f"post {self._posts}: source of descriptor 0 moved to {shifted}")
        return [attrs.evolve(first, local_offset=shifted), *descriptors[1:]]

    def check(self, handle: TransferHandle) -> TransferStatus:
        """The inner status, rewritten by the fault the transfer carries."""
        state = self._posted.get(id(handle))
        if state is None:
            return self._inner.check(handle)
        if state.final is not None:
            return state.final
        if self._is_disconnected(state.peer):
            # Cancel first, so that nothing lands after FAILED is reported (SM-2).
            self._release_inner(state)
            return self._finish(state, FailureReason.PEER_DISCONNECTED, "injected disconnect")
        if not self._issue(state):
            return TransferStatus(state=TransferState.PENDING)
        if state.final is not None:  # the held post was refused when it reached the inner agent
            return state.final
        status = self._inner.check(state.issued or handle)
        if status.state is not TransferState.DONE:
            if status.state is TransferState.FAILED:
                state.final = status
            return status
        if state.fault == "partial":
            return self._finish(state, FailureReason.PARTIAL_TRANSFER, "injected partial transfer")
        if state.corrupt_at is not None:
            region, offset = state.corrupt_at
            self._regions[region][offset] ^= 0xFF
            state.corrupt_at = None
        if state.fault == "flip":
            # Every byte landed and the notification went; the caller is told the transfer failed (FAIL-1).
            self._record("flip_status", "a completed transfer reported FAILED")
            return self._finish(state, FailureReason.TRANSFER_ERROR, "injected status flip: the transfer completed")
        state.final = status
        return status

    def _issue(self, state: _Posted) -> bool:
        """Whether ``state``'s post reached the inner agent; a held one goes once its latency passed (DONE-1)."""
        if state.held is None:
            return True
        if time.monotonic() < state.issue_at:
            return False
        mode, descriptors, notification = state.held
        state.held = None
        try:
            state.issued = self._inner.post(mode, descriptors, peer=state.peer, notification=notification)
        except KVSpecError as exc:
            reason = exc.reason if isinstance(exc, TransportError) else FailureReason.POST_FAILED
            self._finish(state, reason, f"delayed post refused: {exc}")
            state.inner_released = True
        return True

    def _issue_due(self) -> None:
        """Let held posts whose latency passed reach the inner agent, as a progressing engine would."""
        for state in list(self._posted.values()):
            if state.held is not None and state.final is None and not self._is_disconnected(state.peer):
                self._issue(state)

    def _finish(self, state: _Posted, reason: FailureReason, detail: str) -> TransferStatus:
        state.final = TransferStatus(state=TransferState.FAILED, reason=reason, detail=detail)
        return state.final

    def _release_inner(self, state: _Posted) -> None:
        if not state.inner_released:
            state.inner_released = True
            if state.held is not None:
                state.held = None  # never posted: nothing to cancel
                return
            self._inner.release(state.issued or state.inner)

    def release(self, handle: TransferHandle) -> None:
        """Release the inner handle (once)."""
        state = self._posted.pop(id(handle), None)
        if state is None:
            self._inner.release(handle)
            return
        self._release_inner(state)

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send through the inner agent; refused while the peer is cut off."""
        self._refuse_if_disconnected(peer)
        self._inner.send_notification(peer, message)

    def get_notifications(self) -> Sequence[Notification]:
        """The inner notifications after drop, delay, duplicate and reorder faults."""
        self._issue_due()
        arrived = [n for n in self._inner.get_notifications() if not self._is_disconnected(n.peer)]
        out = self._release_delayed()
        # A notification held for reordering goes out right behind a later one (``mark``: fresh ones seen so far).
        marks = {id(h): 0 for h in self._held}
        fresh = 0
        for note in arrived:
            verdict = self._judge(note)
            if verdict == "hold":
                marks[id(self._held[-1])] = fresh
                continue
            if verdict == "drop":
                continue
            out.append(note)
            fresh += 1
            if verdict == "duplicate":
                out.append(note)
        still: list[_Held] = []
        for held in self._held:
            if held.behind_next:
                held.polls_left -= 1
                if fresh > marks[id(held)] or held.polls_left <= 0:
                    out.append(held.notification)
                    continue
            still.append(held)
        self._held = still
        return out

    def _release_delayed(self) -> list[Notification]:
        out: list[Notification] = []
        still: list[_Held] = []
        for held in self._held:
            if not held.behind_next:
                held.polls_left -= 1
                if held.polls_left < 0 and time.monotonic() >= held.due_time:
                    out.append(held.notification)
                    continue
            still.append(held)
        self._held = still
        return out

    def _judge(self, note: Notification) -> str:
        plan = self._plan
        drop, delay, duplicate, reorder = (
            self._roll(p)
            for p in (
                plan.drop_notifications,
                plan.delay_notifications,
                plan.duplicate_notifications,
                plan.reorder_notifications,
            )
        )
        what = f"from {note.peer!r}: {note.message[:32]!r}"
        if drop:
            self._record("drop_notification", what)
            return "drop"
        if delay or reorder:
            self._record("delay_notification" if delay else "reorder_notification", what)
            polls = plan.delay_polls if delay else max(plan.delay_polls, 1)
            due = time.monotonic() + plan.delay_seconds if delay else 0.0
            self._held.append(_Held(notification=note, polls_left=polls, behind_next=not delay, due_time=due))
            return "hold"
        if duplicate:
            self._record("duplicate_notification", what)
            return "duplicate"
        return "deliver"

    def close(self) -> None:
        """Close the inner agent."""
        self._inner.close()


class FaultyBackend:
    """Wraps any :class:`Backend`; every agent it creates is a :class:`FaultInjector`."""

    def __init__(self, inner: Backend, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan
        self._agents: list[FaultInjector] = []

    @property
    def inner(self) -> Backend:
        """The wrapped backend."""
        return self._inner

    @property
    def name(self) -> str:
        """``faulty(<inner name>)``."""
        return f"faulty({self._inner.name})"

    @property
    def capabilities(self) -> Capabilities:
        """The inner backend's capabilities."""
        return self._inner.capabilities

    @property
    def agents(self) -> tuple[FaultInjector, ...]:
        """Every agent created so far."""
        return tuple(self._agents)

    @property
    def injected(self) -> tuple[InjectedFault, ...]:
        """Every fault fired by every agent, agent by agent."""
        return tuple(fault for agent in self._agents for fault in agent.injected)

    def create_agent(self, name: str) -> FaultInjector:
        """Create an inner agent and wrap it."""
        agent = FaultInjector(self._inner.create_agent(name), self._plan)
        self._agents.append(agent)
        return agent

    def close(self) -> None:
        """Close the inner backend."""
        self._inner.close()
