"""Transports: the interface, and the backends that implement it."""

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
from kvspec.transport._registry import BUILTIN_BACKENDS, load_backend

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "Capabilities",
    "Descriptor",
    "MemoryRegion",
    "Notification",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "Transport",
    "load_backend",
]
