"""Mutant backends and connectors, each breaking exactly one rule; the suite must catch every one.

Backend mutants wrap the loopback backend's agents (the transport seam);
connector mutants replace one hook of the reference connector (the connector
seam, :class:`kvspec_conformance.Connector`), because front-trimming, clipping
and id mix-ups live in connector logic, not in a transport.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import kvspec_conformance._parallel_scenario as _par_scenario
import pytest
from kvspec_conformance import ReferenceConnector, select_cases

import kvspec.drivers._driver as _driver
import kvspec.drivers._engine as _engine
import kvspec.spec.parallel as _parallel
from kvspec import (
    BlockDigests,
    BlockIds,
    BlockLists,
    ChunkedLocalAttentionSpec,
    DType,
    EngineDescriptor,
    FailureReason,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    PageDigester,
    TransferMode,
    TransferParams,
    TransferRequest,
    TransportError,
    UnsupportedHybridError,
)
from kvspec.drivers._driver import LiveRequest, Moment
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint
from kvspec.protocol._plan import BlockPairsLike
from kvspec.protocol._session import ProducerSession
from kvspec.reference._messages import BlockOffer, Message
from kvspec.reference._reference import BlockPairs, check_window_coverage, compute_block_pairs
from kvspec.spec import CACHE_KINDS, get_blocks_per_sw, get_exchange_clipped_blocks
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, RankCopy, SubBlock
from kvspec.spec.state import (
    check_state_position,
    get_state_clipped_slots,
    get_state_group_indices,
    get_state_paired_lists,
)
from kvspec.transport import Backend, Capabilities, Descriptor, MemoryRegion, Notification, TransferHandle
from kvspec.transport._base import TransferState, TransferStatus, Transport
from kvspec.transport.loopback import LoopbackBackend

__all__ = [
    "BACKEND_MUTANTS",
    "CACHE_MUTANTS",
    "CONNECTOR_MUTANTS",
    "DRIVER_MUTANTS",
    "ENDPOINT_MUTANTS",
    "FAULT_BACKEND_MUTANTS",
    "FAULT_DRIVER_MUTANTS",
    "PARALLEL_MUTANTS",
    "SCORE",
    "STATE_ENDPOINT_MUTANTS",
    "CorruptsAfterCopy",
    "DriverMutant",
    "EndpointMutant",
    "LogsErrors",
    "MutantBackend",
    "ParallelMutant",
]

_NO_ENDS: dict[str, Any] = {"producer_block_ends": None, "consumer_block_ends": None}
"""What a protocol 1.0 peer says of where its lists end: nothing."""


class _Agent:
    """Delegates every Transport call to the loopback agent it wraps; mutants override one behaviour."""

    def __init__(self, inner: Transport, backend: MutantBackend) -> None:
        self.inner = inner
        self.backend = backend
        self.regions: list[memoryview] = []

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register_memory(regions)
        self.regions += [r.buffer for r in regions]
        self.backend.regions[self.name] = self.regions

    def get_agent_metadata(self) -> bytes:
        return self.inner.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        return self.inner.add_remote_agent(metadata)

    def remove_remote_agent(self, peer: str) -> None:
        self.inner.remove_remote_agent(peer)

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        return self.inner.post(mode, descriptors, peer=peer, notification=notification)

    def check(self, handle: TransferHandle) -> TransferStatus:
        return self.inner.check(handle)

    def release(self, handle: TransferHandle) -> None:
        self.inner.release(handle)

    def send_notification(self, peer: str, message: bytes) -> None:
        self.inner.send_notification(peer, message)

    def get_notifications(self) -> Sequence[Notification]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()


class MutantBackend:
    """A loopback backend whose agents are ``agent_class`` wrappers."""

    agent_class: type[_Agent] = _Agent
    breaks: str = ""
    caught_by: tuple[str, ...] = ()  # cases that must fail, besides the rule as a whole

    def __init__(self) -> None:
        # Small chunks keep transfers in flight over several polls, so "early" is observable.
        self.inner = LoopbackBackend(chunk_bytes=256)
        self.regions: dict[str, list[memoryview]] = {}

    @property
    def name(self) -> str:
        return f"mutant-{type(self).__name__}"

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def create_agent(self, name: str) -> Transport:
        return self.agent_class(self.inner.create_agent(name), self)

    def close(self) -> None:
        self.inner.close()


# --------------------------------------------------------------------------- backend mutants


class _EarlyCompletionAgent(_Agent):
    """Reports DONE (and sends the post's notification) before a single byte has moved."""

    def __init__(self, inner: Transport, backend: MutantBackend) -> None:
        super().__init__(inner, backend)
        self.reported: set[int] = set()
        self.kept: list[TransferHandle] = []

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        handle = self.inner.post(mode, descriptors, peer=peer)
        if notification is not None:
            self.inner.send_notification(peer, notification)  # ahead of the data
        return handle

    def check(self, handle: TransferHandle) -> TransferStatus:
        if handle.transfer_id not in self.reported:
            self.reported.add(handle.transfer_id)
            return TransferStatus(state=TransferState.DONE)
        return self.inner.check(handle)

    def release(self, handle: TransferHandle) -> None:
        self.kept.append(handle)  # the copy goes on and lands later


class EarlyCompletion(MutantBackend):
    """Completion reported before the data lands."""

    agent_class = _EarlyCompletionAgent
    breaks = "DONE-1"


class _FailedAsDoneAgent(_Agent):
    def check(self, handle: TransferHandle) -> TransferStatus:
        status = self.inner.check(handle)
        if status.state is TransferState.FAILED:
            return TransferStatus(state=TransferState.DONE)
        return status


class FailedAsDone(MutantBackend):
    """A failed transfer reported as done."""

    agent_class = _FailedAsDoneAgent
    breaks = "FAIL-1"
    caught_by = ("FAIL-1/transport-peer-dies-matrix",)


class _SilentAgent(_Agent):
    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        return self.inner.post(mode, descriptors, peer=peer)

    def send_notification(self, peer: str, message: bytes) -> None:
        return None


class NeverNotifies(MutantBackend):
    """A notification is never sent (neither attached to a post nor on its own)."""

    agent_class = _SilentAgent
    breaks = "REL-1"
    caught_by = ("REL-1/one-release-per-request",)


class _WrongLayerAgent(_Agent):
    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        # Rotate the destination region: pages land in the next tensor, i.e. another group or layer.
        count = len(self.backend.regions.get(peer if mode is TransferMode.WRITE else self.name, ()))
        if count > 1:
            if mode is TransferMode.READ:
                descriptors = [attrs.evolve(d, local_region=(d.local_region + 1) % count) for d in descriptors]
            else:
                descriptors = [attrs.evolve(d, remote_region=(d.remote_region + 1) % count) for d in descriptors]
        return self.inner.post(mode, descriptors, peer=peer, notification=notification)


class WrongLayer(MutantBackend):
    """Pages written into the wrong group or layer."""

    agent_class = _WrongLayerAgent
    breaks = "PLAN-1"


@attrs.define
class _Zombie:
    mode: TransferMode
    descriptors: list[Descriptor]
    peer: str
    lands_at: float


class _EarlyFreeAgent(_Agent):
    """``release`` of a PENDING transfer returns at once, but the copy lands 0.25 s later, past the drain bound."""

    def __init__(self, inner: Transport, backend: MutantBackend) -> None:
        super().__init__(inner, backend)
        self.posted: dict[int, tuple[TransferMode, list[Descriptor], str]] = {}
        self.pending: set[int] = set()
        self.zombies: list[_Zombie] = []

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        handle = self.inner.post(mode, descriptors, peer=peer, notification=notification)
        self.posted[handle.transfer_id] = (mode, list(descriptors), peer)
        self.pending.add(handle.transfer_id)
        return handle

    def check(self, handle: TransferHandle) -> TransferStatus:
        self._haunt()
        status = self.inner.check(handle)
        if status.state is not TransferState.PENDING:
            self.pending.discard(handle.transfer_id)
        return status

    def release(self, handle: TransferHandle) -> None:
        if handle.transfer_id in self.pending:
            mode, descriptors, peer = self.posted[handle.transfer_id]
            lands_at = time.monotonic() + 0.25
            self.zombies.append(_Zombie(mode=mode, descriptors=descriptors, peer=peer, lands_at=lands_at))
        self.inner.release(handle)

    def get_notifications(self) -> Sequence[Notification]:
        self._haunt()
        return self.inner.get_notifications()

    def _haunt(self) -> None:
        for zombie in list(self.zombies):
            if time.monotonic() < zombie.lands_at:
                continue
            self.zombies.remove(zombie)
            remote = self.backend.regions[zombie.peer]
            for d in zombie.descriptors:
                local = (self.regions[d.local_region], d.local_offset)
                far = (remote[d.remote_region], d.remote_offset)
                (source, s_off), (dest, d_off) = (far, local) if zombie.mode is TransferMode.READ else (local, far)
                dest[d_off : d_off + d.nbytes] = source[s_off : s_off + d.nbytes]


class EarlyFree(MutantBackend):
    """Blocks freed while a transfer into them is still in flight (release does not cancel or drain)."""

    agent_class = _EarlyFreeAgent
    breaks = "SM-2"


class _SlowCancelAgent(_EarlyFreeAgent):
    """Lands a released transfer's bytes 50 ms after release: inside any drain bound, yet it claims immediate_cancel."""

    delay = 0.05

    def release(self, handle: TransferHandle) -> None:
        if handle.transfer_id in self.pending:
            mode, descriptors, peer = self.posted[handle.transfer_id]
            lands_at = time.monotonic() + self.delay
            self.zombies.append(_Zombie(mode=mode, descriptors=descriptors, peer=peer, lands_at=lands_at))
        self.inner.release(handle)


class SlowCancel(MutantBackend):
    """Declares immediate_cancel, but bytes of a released transfer still land after release returns."""

    agent_class = _SlowCancelAgent
    breaks = "SM-2"
    caught_by = ("SM-2/transport-release-pending",)


class _LateWriteAgent(_EarlyFreeAgent):
    """Copies every finished transfer again half a second after it reported DONE (a stray retry)."""

    def check(self, handle: TransferHandle) -> TransferStatus:
        status = super().check(handle)
        if status.state is TransferState.DONE and handle.transfer_id in self.posted:
            mode, descriptors, peer = self.posted.pop(handle.transfer_id)
            lands_at = time.monotonic() + 0.5
            self.zombies.append(_Zombie(mode=mode, descriptors=descriptors, peer=peer, lands_at=lands_at))
        return status

    def release(self, handle: TransferHandle) -> None:
        self.inner.release(handle)  # cancels as loopback does: only the late copy after DONE is wrong


class LateWrite(MutantBackend):
    """A transfer's bytes land again half a second after DONE."""

    agent_class = _LateWriteAgent
    breaks = "DONE-1"
    caught_by = ("DONE-1/transport-nothing-lands-after-done", "SM-1/producer-blocks-reused-after-release")


class _DeafAgent(_Agent):
    """Never notices that its peer went away: a transfer failed by peer loss stays PENDING."""

    def check(self, handle: TransferHandle) -> TransferStatus:
        status = self.inner.check(handle)
        if status.reason is FailureReason.PEER_DISCONNECTED:
            return TransferStatus(state=TransferState.PENDING)
        return status


class DeafToPeerLoss(MutantBackend):
    """A dead peer is never noticed; the transfer stays PENDING until the caller's own deadline."""

    agent_class = _DeafAgent
    breaks = "FAIL-1"
    caught_by = ("FAIL-1/transport-peer-loss", "FAIL-1/transport-peer-dies-matrix")


class _TimeoutAgent(_Agent):
    def check(self, handle: TransferHandle) -> TransferStatus:
        status = self.inner.check(handle)
        if status.reason is FailureReason.PEER_DISCONNECTED:
            return TransferStatus(state=TransferState.FAILED, reason=FailureReason.TIMEOUT, detail="timed out")
        return status


class TimeoutForPeerLoss(MutantBackend):
    """Reports a lost peer as a timeout, which hides why the transfer failed."""

    agent_class = _TimeoutAgent
    breaks = "FAIL-1"
    caught_by = ("FAIL-1/transport-peer-loss", "FAIL-1/peer-lost-mid-transfer")


class _WriteMisreportAgent(_Agent):
    def check(self, handle: TransferHandle) -> TransferStatus:
        status = self.inner.check(handle)
        if handle.mode is TransferMode.WRITE and status.state is TransferState.FAILED:
            return TransferStatus(state=TransferState.FAILED, reason=FailureReason.TRANSFER_ERROR, detail="write error")
        return status


class WriteMisreports(MutantBackend):
    """In WRITE mode every failure is reported as a generic transfer error (READ is right)."""

    agent_class = _WriteMisreportAgent
    breaks = "FAIL-1"
    caught_by = ("FAIL-1/transport-peer-loss",)


class _FirstTaskOnlyAgent(_Agent):
    """Completes a batch as Mooncake's ``transfer_check_status`` does: DONE once the first descriptor landed.

    The inner transfer carries the first descriptor (and the notification);
    the rest land at the next call into the agent after DONE was reported
    (the backend progressing later), never before the DONE is seen.
    """

    def __init__(self, inner: Transport, backend: MutantBackend) -> None:
        super().__init__(inner, backend)
        self.rest: dict[int, tuple[TransferMode, list[Descriptor], str]] = {}
        self.due: list[tuple[TransferMode, list[Descriptor], str]] = []

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        self._land()
        descriptors = list(descriptors)
        handle = self.inner.post(mode, descriptors[:1], peer=peer, notification=notification)
        if len(descriptors) > 1:
            self.rest[handle.transfer_id] = (mode, descriptors[1:], peer)
        return handle

    def _land(self) -> None:
        due, self.due = self.due, []
        for mode, descriptors, peer in due:
            remote = self.backend.regions.get(peer, [])
            for d in descriptors:
                local = (self.regions[d.local_region], d.local_offset)
                far = (remote[d.remote_region], d.remote_offset)
                (source, s_off), (dest, d_off) = (far, local) if mode is TransferMode.READ else (local, far)
                dest[d_off : d_off + d.nbytes] = source[s_off : s_off + d.nbytes]

    def check(self, handle: TransferHandle) -> TransferStatus:
        self._land()
        status = self.inner.check(handle)
        rest = self.rest.pop(handle.transfer_id, None) if status.state is TransferState.DONE else None
        if rest is not None:
            self.due.append(rest)  # DONE is reported now; these land on the next call
        return status

    def release(self, handle: TransferHandle) -> None:
        self._land()
        self.rest.pop(handle.transfer_id, None)
        self.inner.release(handle)

    def send_notification(self, peer: str, message: bytes) -> None:
        self._land()
        self.inner.send_notification(peer, message)

    def get_notifications(self) -> Sequence[Notification]:
        self._land()
        return self.inner.get_notifications()

    def close(self) -> None:
        self.due.clear()  # the suite frees this memory next
        self.inner.close()


class FirstTaskOnly(MutantBackend):
    """DONE when the first descriptor of a batch landed, the rest landing later (Mooncake, upstream_2026-12 8.3)."""

    agent_class = _FirstTaskOnlyAgent
    breaks = "DONE-1"
    caught_by = ("DONE-1/completion-implies-visibility",)


class _CorruptsAfterCopyAgent(_Agent):
    """Copies every byte right, then flips one byte of the first page it wrote once it has reported DONE."""

    def __init__(self, inner: Transport, backend: MutantBackend) -> None:
        super().__init__(inner, backend)
        self.first: dict[int, tuple[TransferMode, Descriptor, str]] = {}

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        handle = self.inner.post(mode, descriptors, peer=peer, notification=notification)
        if descriptors:
            self.first[handle.transfer_id] = (mode, descriptors[0], peer)
        return handle

    def check(self, handle: TransferHandle) -> TransferStatus:
        status = self.inner.check(handle)
        landed = self.first.pop(handle.transfer_id, None) if status.state is TransferState.DONE else None
        if landed is not None:
            mode, d, peer = landed
            dest, offset = (
                (self.regions[d.local_region], d.local_offset)
                if mode is TransferMode.READ
                else (self.backend.regions[peer][d.remote_region], d.remote_offset)
            )
            dest[offset + d.nbytes // 2] ^= 0x5A  # after the copy: the bytes were right when DONE was decided
        return status


class CorruptsAfterCopy(MutantBackend):
    """A correct copy whose destination page is damaged afterwards (a stale DMA, a reused buffer): INT-1 catches it."""

    agent_class = _CorruptsAfterCopyAgent
    breaks = "INT-1"


BACKEND_MUTANTS: tuple[type[MutantBackend], ...] = (
    EarlyCompletion,
    FailedAsDone,
    NeverNotifies,
    WrongLayer,
    EarlyFree,
    SlowCancel,
    LateWrite,
    DeafToPeerLoss,
    TimeoutForPeerLoss,
    WriteMisreports,
    FirstTaskOnly,
)


# --------------------------------------------------------------------------- connector mutants


class FrontTrim(ReferenceConnector):
    """Pairs C's list with the FRONT of P's list (the vLLM B5 bug) instead of its tail."""

    breaks = "ALIGN-1"

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        check_window_coverage(config, request)
        producer_block_ids, consumer_block_ids = request.producer_block_ids, request.consumer_block_ids
        if len(consumer_block_ids) == 0:
            return BlockPairs(producer_block_ids=[], consumer_block_ids=[])
        pairs_p, pairs_c = [], []
        for p, c in zip(producer_block_ids, consumer_block_ids, strict=True):
            kept = [(pi, ci) for pi, ci in zip(p[: len(c)], c, strict=True) if pi and ci]
            pairs_p.append([pi for pi, _ in kept])
            pairs_c.append([ci for _, ci in kept])
        return BlockPairs(producer_block_ids=pairs_p, consumer_block_ids=pairs_c)


class ProducerIdsAsConsumerIds(ReferenceConnector):
    """Uses the producer's block ids as the consumer's (remote ids taken for local ones)."""

    breaks = "ALIGN-1"

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        pairs = super().pair_block_ids(config, request)
        return BlockPairs(producer_block_ids=pairs.producer_block_ids, consumer_block_ids=pairs.producer_block_ids)


class NoClipping(ReferenceConnector):
    """Never clips sliding-window groups to their budget."""

    breaks = "CLIP-1"

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        return block_ids


class SkipsLastGroup(ReferenceConnector):
    """Leaves the config's last group out of the transfer and loads the rest (vLLM #54926).

    vLLM #54926: a model's draft (MTP) KV-cache group was excluded from the
    connector's transfer groups, so decode started from a draft cache never
    written, with no error. Pairing nothing for a group that needs blocks is
    the same silence at kvspec's seam: the request loads, one group's pages
    never land.
    """

    breaks = "ALIGN-1"
    caught_by = ("ALIGN-1/prefix-hit-every-length",)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        pairs = super().pair_block_ids(config, request)
        if len(pairs.producer_block_ids) < 2:
            return pairs
        producer = [list(g) for g in pairs.producer_block_ids[:-1]] + [[]]
        consumer = [list(g) for g in pairs.consumer_block_ids[:-1]] + [[]]
        return BlockPairs(producer_block_ids=producer, consumer_block_ids=consumer)


def _width_class(descriptor: EngineDescriptor) -> EngineDescriptor:
    # Every dtype replaced by one name per width: what a check comparing item sizes sees.
    by_width = {1: "int8", 2: "float16", 4: "float32"}
    groups = tuple(
        g if g.dtype is None else attrs.evolve(g, dtype=by_width[DType.from_name(g.dtype).itemsize])
        for g in descriptor.groups
    )
    return attrs.evolve(descriptor, groups=groups)


class WidthOnlyHandshake(ReferenceConnector):
    """Compares dtypes by width only, so float16 meets bfloat16 (and int8 meets fp8) unrefused."""

    breaks = "HS-1"
    caught_by = ("HS-1/every-field-alone",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(_width_class(producer), _width_class(consumer))


# --------------------------------------------------------------------------- state connector mutants (STATE-2..5)


class StateNotMoved(ReferenceConnector):
    """Pairs the attention groups and drops every state pair: the state never moves, yet the load is DONE."""

    breaks = "STATE-2"
    caught_by = (
        "STATE-2/one-slot-moves",
        "STATE-2/state-window-and-full",
        "STATE-2/scratch-slots-never-travel",
        "STATE-1/recomputed-tokens-0-to-3",
        "STATE-4/align-prefix-hits",
    )

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        pairs = super().pair_block_ids(config, request)
        states = set(get_state_group_indices(config))

        def keep(lists: BlockIds) -> list[list[int]]:
            return [[] if g in states else list(ids) for g, ids in enumerate(lists)]

        return BlockPairs(
            producer_block_ids=keep(pairs.producer_block_ids), consumer_block_ids=keep(pairs.consumer_block_ids)
        )


class SendsScratchSlot(ReferenceConnector):
    """Clips a state group to its list's last slot, scratch or not: a speculative scratch slot travels."""

    breaks = "STATE-2"
    caught_by = ("STATE-2/scratch-slots-never-travel", "STATE-2/clip-keeps-the-state-slot")

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        clipped = get_exchange_clipped_blocks(block_ids, get_blocks_per_sw(config))
        states = set(get_state_group_indices(config))
        return BlockIds([ids[-1:] if g in states else ids for g, ids in enumerate(clipped)])


@attrs.frozen(kw_only=True)
class _RawPairs:
    """Pairs as plain lists, unchecked: what a connector that builds its own pairs returns."""

    producer_block_ids: list[list[int]]
    consumer_block_ids: list[list[int]]


_STAND_IN = 10**9  # an id no pool has, standing for the null block while the reference pairs


class PairsNullSlot(ReferenceConnector):
    """Pairs a state group's last slots even when one is the null block, instead of refusing (STATE-3)."""

    breaks = "STATE-3"
    caught_by = ("STATE-3/null-state-slot-refused",)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        states = set(get_state_group_indices(config))

        def hide(lists: BlockIds) -> BlockIds:
            return BlockIds([[_STAND_IN if g in states and b == 0 else b for b in ids] for g, ids in enumerate(lists)])

        hidden = attrs.evolve(
            request,
            producer_block_ids=hide(request.producer_block_ids),
            consumer_block_ids=hide(request.consumer_block_ids),
        )
        pairs = super().pair_block_ids(config, hidden)

        def show(lists: BlockIds) -> list[list[int]]:
            return [[0 if b == _STAND_IN else b for b in ids] for ids in lists]

        # Plain lists: BlockPairs itself refuses the null block (NULL-1), which is what this connector forgot.
        raw = _RawPairs(
            producer_block_ids=show(pairs.producer_block_ids), consumer_block_ids=show(pairs.consumer_block_ids)
        )
        return raw  # type: ignore[return-value]


class PairsConsumerHead(ReferenceConnector):
    """Pairs P's state slot with the FIRST slot C lists, not its last (C's list may be one longer, STATE-3)."""

    breaks = "STATE-3"
    caught_by = ("STATE-3/slots-pair-last-with-last",)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        pairs = super().pair_block_ids(config, request)
        consumer_block_ids = request.consumer_block_ids
        states = set(get_state_group_indices(config))
        consumer = [
            list(consumer_block_ids[g][:1]) if g in states and ids else list(ids)
            for g, ids in enumerate(pairs.consumer_block_ids)
        ]
        return BlockPairs(producer_block_ids=pairs.producer_block_ids, consumer_block_ids=consumer)


class IgnoresStateBoundary(ReferenceConnector):
    """Pairs state slots by STATE-3 and the rest by tail, but never checks the hit against state boundaries."""

    breaks = "STATE-4"
    caught_by = ("STATE-4/hit-off-a-state-boundary-refused",)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        if len(request.consumer_block_ids) == 0:
            return BlockPairs(producer_block_ids=[], consumer_block_ids=[])
        lists = BlockLists(producer_block_ids=request.producer_block_ids, consumer_block_ids=request.consumer_block_ids)
        return compute_block_pairs(get_state_paired_lists(config, lists))


def _same_state_layout(producer: EngineDescriptor, consumer: EngineDescriptor) -> EngineDescriptor:
    # The consumer's state fields replaced by the producer's: what a check that skips them sees.
    fields = ("state_shapes", "state_dtypes", "mamba_type", "conv_layout")
    groups = tuple(
        attrs.evolve(c, **{f: getattr(p, f) for f in fields}) if p.mamba_type is not None else c
        for p, c in zip(producer.groups, consumer.groups, strict=False)
    )
    return attrs.evolve(consumer, groups=groups + consumer.groups[len(groups) :])


class IgnoresStateLayout(ReferenceConnector):
    """Compares every descriptor field but the state layout's: shapes, dtypes, kind and conv layout (STATE-5)."""

    breaks = "STATE-5"
    caught_by = ("STATE-5/state-layouts-must-match",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(producer, _same_state_layout(producer, consumer))


# --------------------------------------------------------------------------- several state groups (issue 37)
# Real models have 3 to 11 state groups; each mutant gets the first one right and the others wrong.


class FirstStateGroupOnly(ReferenceConnector):
    """Clips and pairs the first state group by STATE-2 and STATE-3; later state groups as attention lists.

    What code that looks up "the" state group (``get_state_group_indices(config)[0]``)
    does: the later groups travel unclipped and tail-paired, so the consumer's
    slot receives the producer's last scratch slot, and its placeholders more.
    """

    breaks = "STATE-3"
    caught_by = (
        "STATE-3/several-state-groups",
        "STATE-3/slots-pair-last-with-last",
        "STATE-2/clip-keeps-the-state-slot",
    )

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        clipped = get_exchange_clipped_blocks(block_ids, get_blocks_per_sw(config))
        first = get_state_group_indices(config)[:1]
        return BlockIds(
            [
                get_state_clipped_slots(config.kv_cache_groups[g].kv_cache_spec, ids, group=g) if g in first else ids  # type: ignore[arg-type]
                for g, ids in enumerate(clipped)
            ]
        )

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        pairs = super().pair_block_ids(config, request)
        producer_block_ids, consumer_block_ids = request.producer_block_ids, request.consumer_block_ids
        if len(consumer_block_ids) == 0:
            return pairs
        producer, consumer = [list(g) for g in pairs.producer_block_ids], [list(g) for g in pairs.consumer_block_ids]
        for g in get_state_group_indices(config)[1:]:
            p_ids, c_ids = producer_block_ids[g], consumer_block_ids[g]
            n = min(len(p_ids), len(c_ids))
            kept = [(p, c) for p, c in zip(p_ids[len(p_ids) - n :], c_ids[len(c_ids) - n :], strict=True) if p and c]
            producer[g], consumer[g] = [p for p, _ in kept], [c for _, c in kept]
        return BlockPairs(producer_block_ids=producer, consumer_block_ids=consumer)


def _first_state_spec_everywhere(config: KVCacheConfig) -> KVCacheConfig:
    # Every state group given the first state group's spec: its block size and cache mode decide every boundary.
    states = get_state_group_indices(config)
    if not states:
        return config
    spec = config.kv_cache_groups[states[0]].kv_cache_spec
    groups = [
        attrs.evolve(group, kv_cache_spec=spec) if g in states else group
        for g, group in enumerate(config.kv_cache_groups)
    ]
    return attrs.evolve(config, kv_cache_groups=groups)


class StateBoundaryOfFirstGroup(ReferenceConnector):
    """Checks a prefix hit against the first state group's boundary only (STATE-4 asks every state group's)."""

    breaks = "STATE-4"
    caught_by = ("STATE-4/hit-off-a-state-boundary-refused",)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        return super().pair_block_ids(_first_state_spec_everywhere(config), request)


class IgnoresStateProfile(ReferenceConnector):
    """Compares every descriptor field but the state profile: a recompute peer meets a prebuilt one (STATE-1)."""

    breaks = "STATE-1"
    caught_by = ("STATE-1/state-profiles-refused-at-handshake",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(producer, attrs.evolve(consumer, state_profile=producer.state_profile))


# --------------------------------------------------------------------------- parallel layouts at handshake (PAR-9)


class EqualTpOnly(ReferenceConnector):
    """Drops both peers' parallel layouts, so HS-1 wants equal TP sizes as before protocol 1.3: a TP1 prefill
    and a TP4 decode that compose are refused."""

    breaks = "PAR-9"
    caught_by = ("PAR-9/tp1-to-tp4-admitted",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(attrs.evolve(producer, parallel=None), attrs.evolve(consumer, parallel=None))


def _any_page_fits(descriptor: EngineDescriptor) -> EngineDescriptor:
    # Each page as one replicated HND unit: what a check that looks at the TP sizes alone sees.
    layout = descriptor.parallel
    if layout is None:
        return descriptor
    unit = PageTensor(
        name="page", sub_blocks=[SubBlock(name="all", extent=1, replicated=True)], rows=1, element_bytes=1
    )
    pages = [CanonicalPage(tensors=[unit])] * len(layout.pages)
    return attrs.evolve(descriptor, parallel=attrs.evolve(layout, pages=pages))


class IgnoresPageLayouts(ReferenceConnector):
    """Admits unequal TP on the TP sizes alone, never deriving the byte maps (as vLLM's Mooncake connector skips
    its check when Mamba layers are present): heads that do not divide, an opaque page, other extents all pass."""

    breaks = "PAR-9"
    caught_by = ("PAR-9/layouts-that-do-not-compose-refused",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(_any_page_fits(producer), _any_page_fits(consumer))


CONNECTOR_MUTANTS: tuple[type[ReferenceConnector], ...] = (
    FrontTrim,
    ProducerIdsAsConsumerIds,
    NoClipping,
    WidthOnlyHandshake,
    SkipsLastGroup,
    StateNotMoved,
    SendsScratchSlot,
    PairsNullSlot,
    PairsConsumerHead,
    IgnoresStateBoundary,
    IgnoresStateLayout,
    FirstStateGroupOnly,
    StateBoundaryOfFirstGroup,
    IgnoresStateProfile,
    EqualTpOnly,
    IgnoresPageLayouts,
)

# --------------------------------------------------------------------------- driver mutants (INT-1)
# Integrity lives in the driver core, so its mutants patch the driver (or its digester) for one run.


class DriverMutant:
    """Patches one behaviour of the driver's integrity check (INT-1) for the length of a test."""

    breaks = "INT-1"
    caught_by: tuple[str, ...] = ()

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        raise NotImplementedError


class SkipsIntegrityCheck(DriverMutant):
    """The receiver never checks: a READ's DONE and a WRITE's Completion go straight to LOADED."""

    caught_by = ("INT-1/corruption-with-integrity",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        # Only the row that refuses a READ without digests is left: no block is ever compared.
        rows = tuple(row for row in _driver.INTEGRITY_ROWS if row.moment is Moment.POST)
        monkeypatch.setattr(_driver, "INTEGRITY_ROWS", rows)


class WriteSendsEmptyDigests(DriverMutant):
    """The WRITE sender puts no digest on the Completion (every entry ''), so nothing is checked."""

    caught_by = ("INT-1/corruption-with-integrity",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        def empty(self: PageDigester, pairs: BlockPairsLike, consumer_block_ids: BlockIds) -> BlockDigests:
            return tuple(tuple("" for _ in ids) for ids in consumer_block_ids)

        monkeypatch.setattr(PageDigester, "written_digests", empty)


class DigestsTheNextBlock(DriverMutant):
    """Both sides digest the pages of block b + 1 instead of b: digests over the wrong pages."""

    caught_by = ("INT-1/transport-integrity",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        right = PageDigester.block_digest

        def shifted(self: PageDigester, group: int, block_id: int) -> str:
            return right(self, group, block_id + 1) if block_id and block_id + 1 < self.config.num_blocks else ""

        monkeypatch.setattr(PageDigester, "block_digest", shifted)


DRIVER_MUTANTS: tuple[type[DriverMutant], ...] = (SkipsIntegrityCheck, WriteSendsEmptyDigests, DigestsTheNextBlock)


# --------------------------------------------------------------------------- mutants for the FaultPlan's engine faults
# flip_status, post_latency and fail_registration (issue 37): the driver reads the status a backend reports, so two
# of them patch the driver's check; the third is a backend that resolves memory it never registered.


def _check_as(decide: Callable[[_driver.Driver[Any], LiveRequest[Any], TransferStatus], TransferStatus]) -> Any:
    """A driver ``_check`` that sees each status through ``decide`` (the reference's, otherwise)."""

    def check(self: _driver.Driver[Any], request: LiveRequest[Any]) -> None:
        if request.handle is None:
            return
        try:
            status = self.transport.check(request.handle)
        except TransportError as exc:
            self._drop_handle(request)
            self.execute(request, request.session.transfer_failed(_driver.reason_of(exc), now=self.clock()))
            return
        status = decide(self, request, status)
        if status.state is TransferState.PENDING:
            return
        self._drop_handle(request)
        if status.state is TransferState.DONE:
            self.execute(request, request.session.transfer_done(now=self.clock()))
        else:
            reason = status.reason or FailureReason.TRANSFER_ERROR
            self.execute(request, request.session.transfer_failed(reason, now=self.clock(), detail=status.detail))

    return check


class TransferErrorLoads(DriverMutant):
    """Takes FAILED(transfer_error) as a glitch and the transfer as done: a flipped status ends LOADED (FAIL-1)."""

    breaks = "FAIL-1"
    caught_by = ("FAIL-1/completed-reported-failed",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        def decide(driver: _driver.Driver[Any], request: LiveRequest[Any], status: TransferStatus) -> TransferStatus:
            if status.state is TransferState.FAILED and status.reason is FailureReason.TRANSFER_ERROR:
                return TransferStatus(state=TransferState.DONE)
            return status

        monkeypatch.setattr(_driver.Driver, "_check", _check_as(decide))


class DoneAfterFixedTime(DriverMutant):
    """Counts a transfer done 20 ms after its post, whatever check says: a slow post loads stale pages (DONE-1)."""

    breaks = "DONE-1"
    caught_by = ("DONE-1/slow-posts-load-when-done",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        posted_at: dict[int, float] = {}

        def decide(driver: _driver.Driver[Any], request: LiveRequest[Any], status: TransferStatus) -> TransferStatus:
            first = posted_at.setdefault(id(request.handle), time.monotonic())
            if status.state is TransferState.PENDING and time.monotonic() - first > 0.02:
                return TransferStatus(state=TransferState.DONE)
            return status

        monkeypatch.setattr(_driver.Driver, "_check", _check_as(decide))


FAULT_DRIVER_MUTANTS: tuple[type[DriverMutant], ...] = (TransferErrorLoads, DoneAfterFixedTime)


class _SharedRegistryAgent(_Agent):
    """Resolves a region its agent (or its peer) never registered in a backend-wide table: the first agent's regions.

    As a backend whose registrations are per process rather than per agent: an
    agent whose own registration failed still reads and writes memory, someone else's.
    """

    def __init__(self, inner: Transport, backend: MutantBackend) -> None:
        super().__init__(inner, backend)
        self.faked: set[int] = set()

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        mine, theirs = self.regions, self.backend.regions.get(peer, [])
        if all(d.local_region < len(mine) and d.remote_region < len(theirs) for d in descriptors):
            return self.inner.post(mode, descriptors, peer=peer, notification=notification)
        shared = next(iter(self.backend.regions.values()), [])
        local, remote = mine or shared, theirs or shared
        for d in descriptors:
            near = (local[d.local_region], d.local_offset)
            far = (remote[d.remote_region], d.remote_offset)
            (source, s_off), (dest, d_off) = (far, near) if mode is TransferMode.READ else (near, far)
            dest[d_off : d_off + d.nbytes] = source[s_off : s_off + d.nbytes]
        handle = TransferHandle(transfer_id=-1 - len(self.faked), peer=peer, mode=mode)
        self.faked.add(handle.transfer_id)
        return handle

    def check(self, handle: TransferHandle) -> TransferStatus:
        if handle.transfer_id in self.faked:
            return TransferStatus(state=TransferState.DONE)
        return self.inner.check(handle)

    def release(self, handle: TransferHandle) -> None:
        if handle.transfer_id not in self.faked:
            self.inner.release(handle)


class SharedRegistry(MutantBackend):
    """Registration is backend-wide: an agent whose registration failed moves bytes from another agent's memory."""

    agent_class = _SharedRegistryAgent
    breaks = "FAIL-1"
    caught_by = ("FAIL-1/transport-registration-failure",)


class _ErrorLoggingAgent(_Agent):
    """Moves every byte right, and logs an error at every post (as an engine that complains about nothing)."""

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        logging.getLogger(__name__).error("xfer %s to %s: unexpected completion queue entry", mode.value, peer)
        return self.inner.post(mode, descriptors, peer=peer, notification=notification)


class LogsErrors(MutantBackend):
    """Every transfer right, yet an error logged at every post: the run fails on the log, naming the line."""

    agent_class = _ErrorLoggingAgent
    breaks = "DONE-1"
    caught_by = ()


FAULT_BACKEND_MUTANTS: tuple[type[MutantBackend], ...] = (SharedRegistry,)

# --------------------------------------------------------------------------- endpoint mutants (SM-1, stale references)
# The stale-reference case runs kvspec's exchange endpoints; these patch one endpoint behaviour for one run.


class EndpointMutant:
    """Patches one behaviour of kvspec's exchange endpoints for the length of a test."""

    breaks = "SM-1"
    caught_by: tuple[str, ...] = ("SM-1/stale-transfer-reference",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        raise NotImplementedError


class ServesReleasedBlocks(EndpointMutant):
    """A producer that remembers released requests and serves an offer for one from the blocks it named then.

    Those blocks went back to the pool and now hold another request's KV: the
    consumer loads a previous prompt's (or garbage) pages, as vLLM #52234.
    """

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        ended = ProducerEndpoint._on_end

        def remember(self: ProducerEndpoint, request: LiveRequest[ProducerSession]) -> None:
            self.__dict__.setdefault("served", {})[request.request_id] = request.session.params
            ended(self, request)

        def serve(self: ProducerEndpoint, request_id: str, peer: str, message: Message) -> None:
            params = self.__dict__.get("served", {}).get(request_id)
            if not isinstance(message, BlockOffer) or request_id in self.driver.requests or params is None:
                return
            session = ProducerSession.create(
                request_id=request_id,
                producer_engine_id=params.producer_engine_id,
                producer_block_ids=params.producer_block_ids,
                producer_block_ends=params.producer_block_ends,
                num_tokens=params.num_tokens,
                mode=params.mode,
                now=self.clock(),
                lease_duration=self.lease_duration,
            )
            self.driver.add(LiveRequest(session=session, peer=peer))

        monkeypatch.setattr(ProducerEndpoint, "_on_end", remember)
        monkeypatch.setattr(ProducerEndpoint, "_refuse_offer_for_no_request", serve)


class ForgetsConsumedRequests(EndpointMutant):
    """A consumer that forgets a request once its decode finished, so the same reference loads again."""

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        finish = ConsumerEndpoint.finish

        def forget(self: ConsumerEndpoint, request_id: str) -> None:
            finish(self, request_id)
            self._results.pop(request_id, None)

        monkeypatch.setattr(ConsumerEndpoint, "finish", forget)


ENDPOINT_MUTANTS: tuple[type[EndpointMutant], ...] = (ServesReleasedBlocks, ForgetsConsumedRequests)


# --------------------------------------------------------------------------- state endpoint mutants (STATE-1, STATE-3)
# Where a state stands and which slot holds it are the engines' business: these patch kvspec's endpoints.


class StateOneTokenLate(EndpointMutant):
    """The producer ships the state one token late: it declares t = T + 1 (the recomputed token applied twice)."""

    breaks = "STATE-1"
    caught_by = ("STATE-1/endpoints-state-at-t-loads",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        prefill = ProducerEndpoint.prefill

        def late(self: ProducerEndpoint, request_id: str, *, num_tokens: int, **kwargs: Any) -> TransferParams:
            if kwargs.get("state_tokens") is None:
                kwargs["state_tokens"] = num_tokens + 1
            return prefill(self, request_id, num_tokens=num_tokens, **kwargs)

        monkeypatch.setattr(ProducerEndpoint, "prefill", late)


class ResumesAtWrongT(EndpointMutant):
    """The consumer resumes one token late: it checks t against T + 1, so it refuses t == T and takes t == T + 1."""

    breaks = "STATE-1"
    caught_by = ("STATE-1/endpoints-state-at-t-loads", "STATE-1/endpoints-state-off-t-refused")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        check = check_state_position

        def shifted(config: KVCacheConfig, *, num_tokens: int, **kwargs: Any) -> None:
            check(config, num_tokens=num_tokens + 1, **kwargs)

        monkeypatch.setattr(_engine, "check_state_position", shifted)


class MovesStateSlotAfterOffer(EndpointMutant):
    """The producer moves the state to a fresh slot after advertising the old one (as align mode copies states).

    The advertised slot keeps whatever it held before; the consumer reads it.
    """

    breaks = "STATE-3"
    caught_by = ("STATE-3/endpoints-advertised-slot-holds-the-state",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        prefill = ProducerEndpoint.prefill

        def moved(
            self: ProducerEndpoint,
            request_id: str,
            *,
            num_tokens: int,
            fill: Callable[[BlockIds], None] | None = None,
            **kwargs: Any,
        ) -> TransferParams:
            def fill_elsewhere(ids: BlockIds) -> None:
                states = set(get_state_group_indices(self.config))
                fresh = iter(self.allocator.allocate(len(states)))
                assert fill is not None
                fill(BlockIds([[*g[:-1], next(fresh)] if i in states and g else g for i, g in enumerate(ids)]))

            return prefill(
                self, request_id, num_tokens=num_tokens, fill=None if fill is None else fill_elsewhere, **kwargs
            )

        monkeypatch.setattr(ProducerEndpoint, "prefill", moved)


STATE_ENDPOINT_MUTANTS: tuple[type[EndpointMutant], ...] = (
    StateOneTokenLate,
    ResumesAtWrongT,
    MovesStateSlotAfterOffer,
)

# --------------------------------------------------------------------------- parallel mutants (PAR-*, issue 33)
# The PAR-* cases plan every rank pair with kvspec.spec.parallel and count notifications with it, so each of these
# patches one definition (or the suite's layer pairing) the way a connector gets it wrong; the cases' oracle keeps
# its own arithmetic and must catch every one.


def _parallel_cases(*rules: str) -> tuple[str, ...]:
    return tuple(c.id for c in select_cases(rules=list(rules)))


class ParallelMutant:
    """Patches one parallel mapping for the length of a test; ``caught_by`` are the PAR cases it must fail."""

    breaks = "PAR-1"
    caught_by: tuple[str, ...] = ()

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        raise NotImplementedError


class HeadOffsetOneOff(ParallelMutant):
    """Every rank but the first starts its split units one unit early: a head (or, with replicas, head 0) off by one.

    With 2 KV heads at TP4 ranks 2 and 3 read head 0 like ranks 0 and 1 (SGLang #23746).
    """

    caught_by = _parallel_cases("PAR-1")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        right = _parallel.get_owned_units

        def off(block: SubBlock, *, tp_size: int, tp_rank: int) -> tuple[int, int]:
            start, end = right(block, tp_size=tp_size, tp_rank=tp_rank)
            return (start - 1, end - 1) if start > 0 and not block.replicated else (start, end)

        monkeypatch.setattr(_parallel, "get_owned_units", off)


class NhdReadAsHnd(ParallelMutant):
    """Plans an NHD page (SGLang's) as if it were HND: a rank's heads taken as one run instead of one run per token."""

    breaks = "PAR-2"
    caught_by = _parallel_cases("PAR-2")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        right = _parallel.compute_rank_copies

        def as_hnd(page: CanonicalPage, **kw: int) -> tuple[RankCopy, ...]:
            tensors = [attrs.evolve(t, order=PageOrder.HND) if t.order is PageOrder.NHD else t for t in page.tensors]
            return right(CanonicalPage(tensors=tensors), **kw)

        monkeypatch.setattr(_parallel, "compute_rank_copies", as_hnd)


class SubBlocksScaledByTpRatio(ParallelMutant):
    """Slices a page's split axis as one block by the TP ratio, ignoring its sub-blocks (vLLM #55208).

    With Mamba-2 ``n_groups=1`` from TP1 to TP2, rank 1 reads C as its B and
    state bytes as its C; a GDN or KDA conv reads K channels as Q.
    """

    breaks = "PAR-3"
    caught_by = _parallel_cases("PAR-3")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        right = _parallel.compute_rank_copies

        def scaled(page: CanonicalPage, **kw: int) -> tuple[RankCopy, ...]:
            def merged(t: PageTensor) -> PageTensor:
                units = sum(b.extent * b.width for b in t.sub_blocks)
                return attrs.evolve(t, sub_blocks=[SubBlock(name=t.name, extent=units)])

            return right(CanonicalPage(tensors=[merged(t) for t in page.tensors]), **kw)

        monkeypatch.setattr(_parallel, "compute_rank_copies", scaled)


class ReplicasWrittenTwice(ParallelMutant):
    """Every producer rank holding a replica sends it: a replicated head or latent written by several ranks."""

    breaks = "PAR-4"
    caught_by = _parallel_cases("PAR-4")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        right = _parallel.compute_rank_copies

        def every_holder(
            page: CanonicalPage, *, producer_tp: int, consumer_tp: int, consumer_rank: int
        ) -> tuple[RankCopy, ...]:
            copies = right(page, producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank)
            maps = {
                r: _parallel.get_rank_page_map(page, tp_size=producer_tp, tp_rank=r)
                for r in _parallel.get_candidate_ranks(
                    producer_tp=producer_tp, consumer_tp=consumer_tp, consumer_rank=consumer_rank
                )
            }
            extra = [
                attrs.evolve(c, producer_rank=r)
                for c in copies
                for r, runs in maps.items()
                if r != c.producer_rank and runs == maps[c.producer_rank]
            ]
            return (*copies, *extra)

        monkeypatch.setattr(_parallel, "compute_rank_copies", every_holder)


class SlicesOpaquePages(ParallelMutant):
    """Never checks the page layout: an opaque page (interleaved scales) is sliced as if it were HND."""

    breaks = "PAR-5"
    caught_by = _parallel_cases("PAR-5")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_parallel, "check_page_sliceable", lambda page, **kw: None)


class FreesAtFirstNotification(ParallelMutant):
    """A producer rank frees a request's blocks at the first consumer rank's notification."""

    breaks = "PAR-6"
    caught_by = ("PAR-6/producer-waits-for-every-consumer-rank",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_parallel, "get_completion_count", lambda **kw: 1)


class CountsOnlyReadRanks(ParallelMutant):
    """A producer rank counts only the consumer ranks that read from it: with MLA and P > D, the unread ranks
    expect no notification and free at once, then hear one for a freed request."""

    breaks = "PAR-6"
    caught_by = ("PAR-6/mla-unread-ranks-notify",)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        right = _parallel.get_completion_count

        def readers(*, producer_tp: int, consumer_tp: int, producer_rank: int, consumer_dcp: int = 1) -> int:
            ratio = producer_tp // consumer_tp
            if ratio > 1 and producer_rank % ratio:
                return 0  # the elected rank is the first of each group: the others think nobody needs them
            return right(
                producer_tp=producer_tp, consumer_tp=consumer_tp, producer_rank=producer_rank, consumer_dcp=consumer_dcp
            )

        monkeypatch.setattr(_parallel, "get_completion_count", readers)


class PairsLayersByPosition(ParallelMutant):
    """Pairs the consumer's i-th layer with the i-th layer of the producer's stages in stage order (vllm-ascend
    #15900): with the consumer's layers listed by group, attention reads a GDN layer's pages."""

    breaks = "PAR-7"
    caught_by = _parallel_cases("PAR-7")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        def by_position(
            producer_stages: Sequence[Sequence[str]], consumer_layers: Sequence[str]
        ) -> dict[str, tuple[int, int]]:
            flat = [(s, i) for s, stage in enumerate(producer_stages) for i in range(len(stage))]
            return dict(zip(consumer_layers, flat, strict=True))

        monkeypatch.setattr(_par_scenario, "pair_layers", by_position)


class DcpRanksReadTheSameTokens(ParallelMutant):
    """Every DCP rank takes the block's first tokens, ignoring its rank and the interleave."""

    breaks = "PAR-8"
    caught_by = _parallel_cases("PAR-8")

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_parallel, "get_dcp_token_position", lambda local_index, **kw: local_index)


PARALLEL_MUTANTS: tuple[type[ParallelMutant], ...] = (
    HeadOffsetOneOff,
    NhdReadAsHnd,
    SubBlocksScaledByTpRatio,
    ReplicasWrittenTwice,
    SlicesOpaquePages,
    FreesAtFirstNotification,
    CountsOnlyReadRanks,
    PairsLayersByPosition,
    DcpRanksReadTheSameTokens,
)

# --------------------------------------------------------------------------- cache accounting mutants (CACHE-1)
# Each misses one way a cache goes untransferred in the field: at handshake (check_peer) or in the pairs.


def _undeclared(descriptor: EngineDescriptor) -> EngineDescriptor:
    # What a 1.2 peer sends: its groups are the whole set (CACHE-1 compares nothing then).
    return attrs.evolve(descriptor, caches=None)


def _caches_evolved(descriptor: EngineDescriptor, **changes: Any) -> EngineDescriptor:
    if descriptor.caches is None:
        return descriptor
    return attrs.evolve(descriptor, caches=tuple(attrs.evolve(c, **changes) for c in descriptor.caches))


class IgnoresCacheDeclarations(ReferenceConnector):
    """Compares groups only, as HS-1 did before CACHE-1: both sides omitting their draft groups pass (vLLM #54926)."""

    breaks = "CACHE-1"
    caught_by = ("CACHE-1/draft-groups-omitted",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(_undeclared(producer), _undeclared(consumer))


class UnknownKindAsScratch(ReferenceConnector):
    """Takes a cache kind it does not know for scratch, so an unknown cache declared ephemeral passes."""

    breaks = "CACHE-1"
    caught_by = ("CACHE-1/unknown-kind-refused",)

    @staticmethod
    def _known(descriptor: EngineDescriptor) -> EngineDescriptor:
        if descriptor.caches is None:
            return descriptor
        caches = tuple(
            c if c.kind in CACHE_KINDS else attrs.evolve(c, kind="circular_buffer") for c in descriptor.caches
        )
        return attrs.evolve(descriptor, caches=caches)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(self._known(producer), self._known(consumer))


class AnyCacheEphemeral(ReferenceConnector):
    """Lets any cache be declared ephemeral, a target's indexer or MLA latent too (ROCm/ATOM #1368)."""

    breaks = "CACHE-1"
    caught_by = ("CACHE-1/target-cache-not-ephemeral",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        # Every cache counted as a draft model's, which the consumer may rebuild.
        super().check_peer(_caches_evolved(producer, draft=True), _caches_evolved(consumer, draft=True))


class OwnAccountingOnly(ReferenceConnector):
    """Checks each side's declarations alone and never compares them: peers running different models pass."""

    breaks = "CACHE-1"
    caught_by = ("CACHE-1/cache-sets-differ",)

    def check_peer(self, producer: EngineDescriptor, consumer: EngineDescriptor) -> None:
        super().check_peer(producer, _undeclared(consumer))
        super().check_peer(_undeclared(producer), consumer)


class SkipsIndexerGroup(ReferenceConnector):
    """Pairs every group but the sparse-attention indexer's: the load completes, its pages never land (ATOM #1368)."""

    breaks = "CACHE-1"
    caught_by = ("CACHE-1/every-kind-moves",)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        pairs = super().pair_block_ids(config, request)
        skipped = {g for g, group in enumerate(config.kv_cache_groups) if isinstance(group.kv_cache_spec, IndexerSpec)}

        def keep(lists: BlockIds) -> list[list[int]]:
            return [[] if g in skipped else list(ids) for g, ids in enumerate(lists)]

        return BlockPairs(
            producer_block_ids=keep(pairs.producer_block_ids), consumer_block_ids=keep(pairs.consumer_block_ids)
        )


def _chunks_as_full(config: KVCacheConfig) -> KVCacheConfig:
    # Each chunked-local group as a full-attention spec of the same page: what a connector blind to chunks sees.
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, ChunkedLocalAttentionSpec):
            full = FullAttentionSpec(
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                attention_chunk_size=spec.attention_chunk_size,
            )
            group = attrs.evolve(group, kv_cache_spec=full)
        groups.append(group)
    return attrs.evolve(config, kv_cache_groups=groups)


class ChunkedAsFullAttention(ReferenceConnector):
    """Clips, checks and pairs a chunked-local group as full attention: it wants blocks before the chunk, freed."""

    breaks = "CACHE-1"
    caught_by = ("CACHE-1/chunk-boundaries",)

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        return super().clip_block_ids(_chunks_as_full(config), block_ids)

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        return super().pair_block_ids(_chunks_as_full(config), request)


CACHE_MUTANTS: tuple[type[ReferenceConnector], ...] = (
    IgnoresCacheDeclarations,
    UnknownKindAsScratch,
    AnyCacheEphemeral,
    OwnAccountingOnly,
    SkipsIndexerGroup,
    ChunkedAsFullAttention,
)

# Mutant name -> whether the suite rejected it, filled by tests/test_conformance_mutants.py; the summary prints it.
SCORE: dict[str, bool] = {}


# --------------------------------------------------------------------------- connectors built like vLLM's (issue 12)


class VllmLikeConnector(ReferenceConnector):
    """Pairs the way vLLM 0.33.0's connectors see a request: N-length lists and nothing about where they end.

    vLLM builds both lists for the prompt length N and never states that C
    recomputes token N - 1, so the window it reasons about is token N's; and a
    clipped list carries no end, so it pairs by length alone. Everything else
    is the reference, so only those two habits are judged.
    """

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        # vLLM's own counts: the recomputed token as one more prompt token, no list ends.
        vllm_like = attrs.evolve(request, num_tokens=request.listed_tokens, recomputed_tokens=0, **_NO_ENDS)
        return super().pair_block_ids(config, vllm_like)


class Kvspec10Connector(ReferenceConnector):
    """kvspec 0.1.0's reference (protocol 1.0): knows neither the recomputed token nor list ends."""

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        protocol_1_0 = attrs.evolve(request, recomputed_tokens=0, **_NO_ENDS)
        return super().pair_block_ids(config, protocol_1_0)


class Protocol10Connector(ReferenceConnector):
    """A connector written against the 1.0 seam: the keyword form of ``pair_block_ids``, no protocol 1.1 keywords.

    The suite still runs it, with a DeprecationWarning (the keyword form is removed in kvspec 0.3.0).
    """

    def pair_block_ids(  # type: ignore[override]
        self,
        config: KVCacheConfig,
        *,
        num_tokens: int,
        prefix_hit_tokens: int,
        producer_block_ids: BlockIds,
        consumer_block_ids: BlockIds,
    ) -> BlockPairsLike:
        return super().pair_block_ids(
            config,
            TransferRequest(
                num_tokens=num_tokens,
                prefix_hit_tokens=prefix_hit_tokens,
                producer_block_ids=producer_block_ids,
                consumer_block_ids=consumer_block_ids,
            ),
        )


class KeywordFormConnector(ReferenceConnector):
    """The reference behind the keyword form of ``pair_block_ids`` (protocol 1.1, before the request value)."""

    def pair_block_ids(  # type: ignore[override]
        self,
        config: KVCacheConfig,
        *,
        num_tokens: int,
        prefix_hit_tokens: int,
        producer_block_ids: BlockIds,
        consumer_block_ids: BlockIds,
        recomputed_tokens: int = 0,
        producer_block_ends: tuple[int, ...] | None = None,
        consumer_block_ends: tuple[int, ...] | None = None,
    ) -> BlockPairsLike:
        request = TransferRequest(
            num_tokens=num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            producer_block_ids=producer_block_ids,
            consumer_block_ids=consumer_block_ids,
            recomputed_tokens=recomputed_tokens,
            producer_block_ends=producer_block_ends,
            consumer_block_ends=consumer_block_ends,
        )
        return super().pair_block_ids(config, request)


REFUSAL = "this connector admits no config here (ADM-1, test refusal)"


class RefusingConnector(ReferenceConnector):
    """Refuses every scenario at admission, as a connector does for a hybrid it does not support."""

    def check_admission(self, config: KVCacheConfig, mode: TransferMode) -> None:
        raise UnsupportedHybridError(REFUSAL)


_: Callable[[], Backend] = LoopbackBackend  # the mutants wrap this reference
