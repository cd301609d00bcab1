"""The kvspec error hierarchy: one root, each error also the builtin a caller would catch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "BackendUnavailableError",
    "BlockAlignmentError",
    "ConfigError",
    "GroupCountError",
    "IncompatiblePeerError",
    "KVSpecError",
    "LocalProtocolError",
    "MalformedMessageError",
    "PlanError",
    "ProtocolError",
    "RemoteProtocolError",
    "TransportError",
    "UnsupportedHybridError",
    "UnsupportedVersionError",
    "WindowCoverageError",
]


class KVSpecError(Exception):
    """Root of every error kvspec raises on purpose."""


class ConfigError(KVSpecError, ValueError, TypeError):
    """A model was built with a field of the wrong type or value.

    The message names the class, the field, what was expected and what was found.
    """


class UnsupportedHybridError(KVSpecError, NotImplementedError):
    """A hybrid model has a group kind the exchange does not admit (ADM-1, ADM-2)."""


class GroupCountError(KVSpecError, ValueError):
    """Per-group data has a different number of groups than the config (CLIP-1, ALIGN-1)."""


class BlockAlignmentError(KVSpecError, ValueError):
    """The consumer holds more blocks in a group than the producer offers (ALIGN-1)."""


class WindowCoverageError(KVSpecError, ValueError):
    """A block that covers a needed position is missing or null on one side (WIN-1)."""


class PlanError(KVSpecError, ValueError):
    """A block id or byte range falls outside the registered memory (PLAN-1)."""


class IncompatiblePeerError(KVSpecError, ValueError):
    """The two engines cannot exchange KV; every differing field is listed (HS-1).

    ``differences`` maps a field path such as ``"groups[1].block_size"`` to the
    pair ``(producer_value, consumer_value)``.
    """

    def __init__(self, differences: Mapping[str, tuple[object, object]]) -> None:
        self.differences: dict[str, tuple[object, object]] = dict(differences)
        lines = [f"{field}: producer={p!r} consumer={c!r}" for field, (p, c) in self.differences.items()]
        super().__init__("incompatible peers (HS-1): " + "; ".join(lines))


class ProtocolError(KVSpecError):
    """A message arrived that the state machine cannot accept."""


class LocalProtocolError(ProtocolError, RuntimeError):
    """This side broke the protocol (called an action its state does not allow)."""


class RemoteProtocolError(ProtocolError, ValueError):
    """The peer broke the protocol (sent something its state does not allow)."""


class UnsupportedVersionError(KVSpecError, ValueError):
    """A message or peer speaks another major protocol version (VER-1)."""


class MalformedMessageError(KVSpecError, ValueError):
    """Bytes or a dict that do not decode into a valid message (VER-1).

    ``field`` names the offending field when one can be named.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message if field is None else f"{field}: {message}")


class TransportError(KVSpecError, RuntimeError):
    """A backend could not post, move or report a transfer.

    ``reason`` is the typed :class:`kvspec.FailureReason` value name so that
    callers can branch on it without parsing the message.
    """

    def __init__(self, message: str, *, reason: str = "transfer_error") -> None:
        self.reason = reason
        super().__init__(message)


class BackendUnavailableError(KVSpecError, ImportError):
    """An optional backend's dependency is not installed; the message says how."""


def format_values(values: Sequence[object]) -> str:
    """Render a short, stable list of values for an error message."""
    shown = ", ".join(repr(v) for v in values[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"
