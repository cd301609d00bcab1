"""The in-process loopback backend: the faithful, asynchronous reference Transport (stdlib only)."""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections import deque
from collections.abc import Sequence

import attrs

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, PlanError, TransportError
from kvspec.transport._base import (
    Capabilities,
    Descriptor,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    check_descriptors,
    closed_agent_error,
    unknown_handle_error,
    unknown_peer_error,
    unreadable_metadata_error,
)

__all__ = ["LoopbackAgent", "LoopbackBackend"]

_METADATA_KIND = "kvspec-loopback"
_COLUMNS = ("local_region", "local_offset", "remote_region", "remote_offset", "nbytes")
_DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024

# (destination region, destination offset, source region, source offset, nbytes), already checked.
_Copy = tuple[memoryview, int, memoryview, int, int]

_PENDING = TransferStatus(state=TransferState.PENDING)

LOOPBACK_CAPABILITIES = Capabilities(
    modes=frozenset({TransferMode.READ, TransferMode.WRITE}),
    notifications=True,
    cross_process=False,
    integrity=False,
    observable_in_flight=True,
    immediate_cancel=True,  # release() of a pending transfer drops its queued copies under the lock
)


@attrs.define(eq=False)
class _Transfer:
    """One posted transfer; mutated only under the fabric lock."""

    handle: TransferHandle
    initiator: LoopbackAgent
    target: LoopbackAgent
    copies: list[_Copy]
    notification: bytes | None
    next_copy: int = 0
    landed: bool = False
    status: TransferStatus = attrs.field(factory=lambda: _PENDING)


class _Fabric:
    """The shared medium of one backend: agents by name and every pending transfer."""

    def __init__(self, chunk_bytes: int) -> None:
        self.fabric_id = uuid.uuid4().hex
        self.chunk_bytes = chunk_bytes
        self.lock = threading.RLock()
        self.agents: dict[str, LoopbackAgent] = {}
        self.pending: list[_Transfer] = []
        self.ids = itertools.count(1)

    def progress(self, agent: LoopbackAgent) -> None:
        """Advance every pending transfer ``agent`` takes part in by one step.

        A step copies up to ``chunk_bytes``; a transfer whose bytes have all
        landed is reported DONE, and its notification queued, on the step
        after, so a poller always sees it PENDING with its data visible first
        (DONE-1).
        """
        still: list[_Transfer] = []
        for transfer in self.pending:
            if transfer.initiator is agent or transfer.target is agent:
                self._step(transfer)
            if transfer.status.state is TransferState.PENDING:
                still.append(transfer)
        self.pending = still

    def _step(self, transfer: _Transfer) -> None:
        if transfer.landed:
            transfer.status = TransferStatus(state=TransferState.DONE)
            if transfer.notification is not None:
                transfer.target.inbox.append(Notification(peer=transfer.initiator.name, message=transfer.notification))
            return
        budget = self.chunk_bytes
        copies = transfer.copies
        index = transfer.next_copy
        end = len(copies)
        # The hot loop: memoryview slice assignment is a memcpy; keep it bare.
        while index < end and budget > 0:
            destination, d_offset, source, s_offset, nbytes = copies[index]
            destination[d_offset : d_offset + nbytes] = source[s_offset : s_offset + nbytes]
            budget -= nbytes
            index += 1
        transfer.next_copy = index
        transfer.landed = index == end

    def fail_transfers_with(self, agent: LoopbackAgent, detail: str) -> None:
        """Fail every pending transfer involving ``agent`` (it closed or was forgotten)."""
        for transfer in self.pending:
            if transfer.initiator is agent or transfer.target is agent:
                transfer.status = TransferStatus(
                    state=TransferState.FAILED, reason=FailureReason.PEER_DISCONNECTED, detail=detail
                )
        self.pending = [t for t in self.pending if t.status.state is TransferState.PENDING]


class LoopbackAgent:
    """One in-process agent (Transport); transfers progress only when polled.

    ``check``, ``get_notifications`` and ``send_notification`` progress every
    pending transfer this agent takes part in, on either side, as NIXL with
    its progress thread off progresses on any call into the agent.
    """

    def __init__(self, name: str, fabric: _Fabric) -> None:
        self._name = name
        self._fabric = fabric
        self._regions: list[memoryview] = []
        self._peers: dict[str, LoopbackAgent] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._closed = False
        self.inbox: deque[Notification] = deque()

    # -- identity

    @property
    def name(self) -> str:
        """This agent's name."""
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        """Both modes, notifications, in-process, observable in flight."""
        return LOOPBACK_CAPABILITIES

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise closed_agent_error(self._name)

    # -- memory and peers

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register buffers; descriptors refer to them by index, in this order."""
        with self._fabric.lock:
            self._check_open()
            for region in regions:
                view = region.buffer
                if view.readonly:
                    raise PlanError(f"loopback agent {self._name!r}: region {len(self._regions)} is read-only")
                if not view.c_contiguous:
                    raise PlanError(f"loopback agent {self._name!r}: region {len(self._regions)} is not contiguous")
                self._regions.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)

    def get_agent_metadata(self) -> bytes:
        """JSON naming the fabric, the agent and its region sizes."""
        with self._fabric.lock:
            self._check_open()
            meta = {
                "kind": _METADATA_KIND,
                "fabric": self._fabric.fabric_id,
                "name": self._name,
                "regions": [r.nbytes for r in self._regions],
            }
            return json.dumps(meta, sort_keys=True).encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer of the same backend from its metadata; return its name."""
        with self._fabric.lock:
            self._check_open()
            try:
                meta = json.loads(metadata)
                if meta["kind"] != _METADATA_KIND:
                    raise TypeError(meta["kind"])
                fabric, name = meta["fabric"], meta["name"]
            except (ValueError, TypeError, KeyError) as exc:
                raise unreadable_metadata_error(self._name, repr(exc)) from None
            peer = self._fabric.agents.get(name)
            if fabric != self._fabric.fabric_id or peer is None or peer.closed:
                raise TransportError(
                    f"loopback: peer {name!r} is not reachable from this backend",
                    reason=FailureReason.PEER_DISCONNECTED,
                )
            self._peers[name] = peer
            return str(name)

    def remove_remote_agent(self, peer: str) -> None:
        """Forget a peer; transfers in flight with it fail as disconnected."""
        with self._fabric.lock:
            gone = self._peers.pop(peer, None)
            if gone is not None:
                for transfer in self._fabric.pending:
                    if transfer.initiator is self and transfer.target is gone:
                        transfer.status = TransferStatus(
                            state=TransferState.FAILED,
                            reason=FailureReason.PEER_DISCONNECTED,
                            detail=f"peer {peer!r} removed",
                        )
                self._fabric.pending = [t for t in self._fabric.pending if t.status.state is TransferState.PENDING]

    def _peer(self, peer: str) -> LoopbackAgent:
        target = self._peers.get(peer)
        if target is None or target.closed:
            raise unknown_peer_error(self._name, peer)
        return target

    # -- transfers

    def _bind(self, mode: TransferMode, descriptors: Sequence[Descriptor], target: LoopbackAgent) -> list[_Copy]:
        """Check every descriptor against both sides' regions (PLAN-1); return (destination, source) copies."""
        local_regions, remote_regions = self._regions, target._regions
        table = check_descriptors(
            descriptors,
            local_sizes=[r.nbytes for r in local_regions],
            remote_sizes=[r.nbytes for r in remote_regions],
        )
        columns = zip(*(table.column(name) for name in _COLUMNS), strict=True)
        if mode is TransferMode.READ:
            return [(local_regions[lr], lo, remote_regions[rr], ro, n) for lr, lo, rr, ro, n in columns]
        return [(remote_regions[rr], ro, local_regions[lr], lo, n) for lr, lo, rr, ro, n in columns]

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Validate every descriptor, then queue the transfer; no byte moves until polled."""
        if not isinstance(mode, TransferMode):
            raise PlanError(f"post: expected a TransferMode, got {mode!r}")
        with self._fabric.lock:
            self._check_open()
            target = self._peer(peer)
            copies = self._bind(mode, descriptors, target)
            handle = TransferHandle(transfer_id=next(self._fabric.ids), peer=peer, mode=mode)
            transfer = _Transfer(handle=handle, initiator=self, target=target, copies=copies, notification=notification)
            self._transfers[handle.transfer_id] = transfer
            self._fabric.pending.append(transfer)
            return handle

    def check(self, handle: TransferHandle) -> TransferStatus:
        """Progress, then report PENDING, DONE or FAILED with a reason."""
        with self._fabric.lock:
            self._check_open()
            transfer = self._transfers.get(handle.transfer_id)
            if transfer is None:
                raise unknown_handle_error(self._name, handle.transfer_id)
            if transfer.status.state is TransferState.PENDING:
                self._fabric.progress(self)
            return transfer.status

    def release(self, handle: TransferHandle) -> None:
        """Drop a handle; a PENDING transfer stops at once (its destination is undefined)."""
        with self._fabric.lock:
            transfer = self._transfers.pop(handle.transfer_id, None)
            if transfer is not None and transfer.status.state is TransferState.PENDING:
                transfer.status = TransferStatus(
                    state=TransferState.FAILED, reason=FailureReason.ABORTED, detail="released while pending"
                )
                self._fabric.pending = [t for t in self._fabric.pending if t is not transfer]

    def send_notification(self, peer: str, message: bytes) -> None:
        """Queue ``message`` for the peer, after anything this agent sent before."""
        with self._fabric.lock:
            self._check_open()
            target = self._peer(peer)
            self._fabric.progress(self)
            target.inbox.append(Notification(peer=self._name, message=bytes(message)))

    def get_notifications(self) -> Sequence[Notification]:
        """Progress, then drain this agent's notifications in arrival order."""
        with self._fabric.lock:
            self._check_open()
            self._fabric.progress(self)
            drained = list(self.inbox)
            self.inbox.clear()
            return drained

    def touches(self, region: int, offset: int, nbytes: int) -> bool:
        """Whether a pending transfer may still read or write ``[offset, offset + nbytes)`` of a local region.

        For tests of SM-1/SM-2: a block may return to its pool only when no
        pending transfer touches its pages.
        """
        with self._fabric.lock:
            if not 0 <= region < len(self._regions):
                return False
            view = self._regions[region]
            end = offset + nbytes
            for transfer in self._fabric.pending:
                if transfer.initiator is not self and transfer.target is not self:
                    continue
                for destination, d_offset, source, s_offset, n in transfer.copies[transfer.next_copy :]:
                    if destination is view and d_offset < end and offset < d_offset + n:
                        return True
                    if source is view and s_offset < end and offset < s_offset + n:
                        return True
            return False

    @property
    def num_pending(self) -> int:
        """Transfers this agent takes part in that are still PENDING."""
        with self._fabric.lock:
            return sum(1 for t in self._fabric.pending if t.initiator is self or t.target is self)

    def close(self) -> None:
        """Close the agent; its pending transfers fail as disconnected. Idempotent."""
        with self._fabric.lock:
            if self._closed:
                return
            self._closed = True
            self._fabric.fail_transfers_with(self, f"agent {self._name!r} closed")
            if self._fabric.agents.get(self._name) is self:
                del self._fabric.agents[self._name]
            self._regions.clear()
            self._transfers.clear()
            self.inbox.clear()


class LoopbackBackend:
    """Creates in-process agents that share one fabric (Backend).

    ``chunk_bytes`` bounds the bytes one poll moves per transfer, so a large
    transfer stays observably in flight across several polls.
    """

    def __init__(self, *, chunk_bytes: int = _DEFAULT_CHUNK_BYTES) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ConfigError(f"LoopbackBackend.chunk_bytes: expected a positive int, got {chunk_bytes!r}")
        self._fabric = _Fabric(chunk_bytes)
        self._agents: list[LoopbackAgent] = []

    @property
    def name(self) -> str:
        """``"loopback"``."""
        return "loopback"

    @property
    def capabilities(self) -> Capabilities:
        """Both modes, notifications, in-process, observable in flight."""
        return LOOPBACK_CAPABILITIES

    def create_agent(self, name: str) -> LoopbackAgent:
        """Start one agent; names are unique among this backend's live agents."""
        with self._fabric.lock:
            existing = self._fabric.agents.get(name)
            if existing is not None and not existing.closed:
                raise TransportError(f"loopback: an agent named {name!r} already exists", reason=FailureReason.PROTOCOL)
            agent = LoopbackAgent(name, self._fabric)
            self._fabric.agents[name] = agent
            self._agents.append(agent)
            return agent

    def close(self) -> None:
        """Close every agent this backend created."""
        for agent in self._agents:
            agent.close()
        self._agents.clear()
