"""The Transport interface every backend implements, shaped after NIXL's agent API."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.core._descriptors import Descriptor, DescriptorBounds, DescriptorList, check_descriptors, merge_runs
from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, TransportError

__all__ = [
    "Capabilities",
    "Descriptor",
    "DescriptorBounds",
    "DescriptorList",
    "MemoryRegion",
    "Notification",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "Transport",
    "check_descriptors",
    "closed_agent_error",
    "merge_runs",
    "unknown_handle_error",
    "unknown_peer_error",
    "unreadable_metadata_error",
]


class TransferState(str, enum.Enum):
    """Where one posted transfer stands, as :meth:`Transport.check` reports it."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@attrs.frozen(kw_only=True)
class TransferStatus:
    """The answer of :meth:`Transport.check`.

    ``DONE`` means every byte of every descriptor is readable at its
    destination (DONE-1). ``FAILED`` carries a typed reason (FAIL-1); the
    destination bytes are then undefined.
    """

    state: TransferState
    reason: FailureReason | None = None
    detail: str = ""

    def __attrs_post_init__(self) -> None:
        if (self.state is TransferState.FAILED) != (self.reason is not None):
            raise ConfigError(f"TransferStatus.reason: expected a reason exactly when FAILED, got {self.reason!r}")


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a backend declares it can do; the conformance suite skips what is absent.

    - ``modes``: READ (initiator pulls from the peer) and/or WRITE (initiator pushes).
    - ``notifications``: ``send_notification`` / ``post(..., notification=)`` work.
    - ``cross_process``: the two agents live in different processes; memory is
      then registered as shared-memory regions (``MemoryRegion.shm_name``).
    - ``integrity``: the backend itself verifies the bytes it moved and reports
      ``FailureReason.INTEGRITY`` when they differ. Without it, the drivers'
      INT-1 check gives any backend integrity (on by default in ``kvspec conform``).
    - ``observable_in_flight``: a posted transfer can be seen ``PENDING``.
    - ``immediate_cancel``: ``release`` of a PENDING transfer stops it before
      returning, so no byte of it lands afterwards. Without it, callers treat a
      cancelled transfer as drained only after their drain timeout (SM-2).
    - ``remote_pools``: one role's agent and pool live on another host
      (:mod:`kvspec.remote`); the caller cannot register memory of its own
      with that agent, and reads that pool only through digests.
    """

    modes: frozenset[TransferMode] = frozenset({TransferMode.READ, TransferMode.WRITE})
    notifications: bool = True
    cross_process: bool = False
    integrity: bool = False
    observable_in_flight: bool = False
    immediate_cancel: bool = False
    remote_pools: bool = False


@attrs.frozen(kw_only=True, eq=False)
class MemoryRegion:
    """A buffer the suite or engine owns and registers with a transport.

    One region per :class:`kvspec.KVCacheTensor`, in the config's tensor order.
    ``shm_name`` names the ``multiprocessing.shared_memory`` block that backs
    ``buffer`` so an agent in another process can attach the same bytes.
    """

    buffer: memoryview
    shm_name: str | None = None

    @property
    def nbytes(self) -> int:
        """Size of the region in bytes."""
        return self.buffer.nbytes


# --------------------------------------------------------------------------- one reason per event
# Every backend raises these for these events, so a driver sees one FailureReason per event whatever
# the backend (docs/reference/transport.md, "Errors and reasons"; FAIL-1).


def closed_agent_error(agent: str) -> TransportError:
    """Any call on an agent after :meth:`Transport.close`: ``PEER_DISCONNECTED`` (the agent is gone) (FAIL-1)."""
    return TransportError(f"agent {agent!r} is closed", reason=FailureReason.PEER_DISCONNECTED)


def unknown_peer_error(agent: str, peer: str) -> TransportError:
    """A post or notification to a peer never added, removed or gone: ``PEER_DISCONNECTED`` (FAIL-1)."""
    return TransportError(
        f"agent {agent!r}: unknown or disconnected peer {peer!r} (add_remote_agent first)",
        reason=FailureReason.PEER_DISCONNECTED,
    )


def unknown_handle_error(agent: str, transfer_id: int) -> TransportError:
    """``check`` of a handle this agent never posted or already released: ``PROTOCOL`` (a caller bug) (FAIL-1)."""
    return TransportError(f"agent {agent!r}: unknown or released handle {transfer_id}", reason=FailureReason.PROTOCOL)


def unreadable_metadata_error(agent: str, detail: str) -> TransportError:
    """``add_remote_agent`` with bytes that are not this backend's metadata: ``PROTOCOL`` (FAIL-1)."""
    return TransportError(f"agent {agent!r}: unreadable peer metadata ({detail})", reason=FailureReason.PROTOCOL)


@attrs.frozen(kw_only=True)
class Notification:
    """A small message from a peer agent, delivered after the data it follows (DONE-1)."""

    peer: str
    message: bytes


@attrs.frozen(kw_only=True, eq=False)
class TransferHandle:
    """Opaque token for one posted transfer; backends subclass or wrap it."""

    transfer_id: int
    peer: str
    mode: TransferMode


@runtime_checkable
class Transport(Protocol):
    """One agent of a backend: registers memory, talks to peers, moves bytes.

    Theory of operation (mirrors ``nixl_agent``):

    1. ``register_memory`` the pool regions, then publish
       ``get_agent_metadata()`` to the peer out of band (the handshake).
    2. ``add_remote_agent(peer_metadata)`` returns the peer's name.
    3. ``post`` a READ or WRITE descriptor list; it validates every descriptor
       against both sides' registered regions and raises
       :class:`kvspec.PlanError` before anything moves when one falls outside,
       or :class:`kvspec.TransportError` when the peer is unknown or gone.
    4. Poll ``check(handle)`` until ``DONE`` or ``FAILED``; never assume
       progress without polling. A passive agent polls
       ``get_notifications()`` so its backend can progress.
    5. ``release`` the handle; ``close`` the agent.

    A notification attached to ``post`` is delivered to the peer only after
    every byte of that transfer is readable there (DONE-1).
    """

    @property
    def name(self) -> str:
        """This agent's name, unique among its peers."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this backend can do."""
        ...

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register the buffers descriptors refer to, by index."""
        ...

    def get_agent_metadata(self) -> bytes:
        """Opaque bytes that let a peer reach this agent and its regions."""
        ...

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata; return its name. Idempotent for the same bytes."""
        ...

    def remove_remote_agent(self, peer: str) -> None:
        """Forget a peer (for instance before it is added again after a restart)."""
        ...

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Start moving bytes; returns at once or after the copy, never partially posted."""
        ...

    def check(self, handle: TransferHandle) -> TransferStatus:
        """Report the transfer's state, progressing it if the backend needs polling."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """Drop a finished handle. Releasing a PENDING transfer cancels it as far as the backend can."""
        ...

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send a message without data (e.g. the consumer's release in READ mode)."""
        ...

    def get_notifications(self) -> Sequence[Notification]:
        """Drain the notifications received so far, in arrival order."""
        ...

    def close(self) -> None:
        """Release every resource; later calls raise :class:`kvspec.TransportError`."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A factory of agents of one transport kind; what ``kvspec conform BACKEND`` loads.

    The conformance suite and the exchange driver create one agent per engine
    role (``create_agent("producer")``, ``create_agent("consumer")``); a
    cross-process backend starts each agent in its own process and returns a
    proxy. ``close`` ends every agent it created.
    """

    @property
    def name(self) -> str:
        """Short backend name, e.g. ``"loopback"``."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What agents of this backend can do."""
        ...

    def create_agent(self, name: str) -> Transport:
        """Start one agent named ``name``."""
        ...

    def close(self) -> None:
        """Stop every agent this backend started."""
        ...
