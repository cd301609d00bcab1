"""Transports: the interface, and the backends that implement it."""

from kvspec.transport._base import (
    Backend,
    Capabilities,
    Descriptor,
    DescriptorBounds,
    DescriptorList,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
    check_descriptors,
    merge_runs,
)
from kvspec.transport._registry import BUILTIN_BACKENDS, is_factory_of, load_backend, parse_backend_options
from kvspec.transport.faults import FaultInjector, FaultPlan, FaultyBackend, InjectedFault
from kvspec.transport.loopback import LoopbackAgent, LoopbackBackend
from kvspec.transport.pace import Pace, PacedBackend, PacedTransport

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "Capabilities",
    "Descriptor",
    "DescriptorBounds",
    "DescriptorList",
    "FaultInjector",
    "FaultPlan",
    "FaultyBackend",
    "InjectedFault",
    "LoopbackAgent",
    "LoopbackBackend",
    "MemoryRegion",
    "Notification",
    "Pace",
    "PacedBackend",
    "PacedTransport",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "Transport",
    "check_descriptors",
    "is_factory_of",
    "load_backend",
    "merge_runs",
    "parse_backend_options",
]
