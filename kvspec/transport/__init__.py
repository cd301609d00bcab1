"""Transports: the interface, and the backends that implement it."""

from kvspec.transport._base import (
    Capabilities,
    Descriptor,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
)

__all__ = [
    "Capabilities",
    "Descriptor",
    "MemoryRegion",
    "Notification",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "Transport",
]
