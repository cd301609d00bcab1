"""The kvspec error hierarchy: one root, each error also the builtin a caller would catch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec._enums import FailureReason

__all__ = [
    "BackendUnavailableError",
    "BlockAlignmentError",
    "ConfigError",
    "FieldError",
    "GroupCountError",
    "IncompatiblePeerError",
    "KVSpecError",
    "LocalProtocolError",
    "MalformedMessageError",
    "OutOfBlocksError",
    "PlanError",
    "ProtocolError",
    "RemoteProtocolError",
    "TransportError",
    "UnknownRuleError",
    "UnsupportedHybridError",
    "UnsupportedVersionError",
    "WindowCoverageError",
]


def shown(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about values a peer sent.

    ``repr`` itself can fail on hostile input (an int of more than 4,300
    digits raises ValueError, deep nesting RecursionError); an error message
    must never raise, so such values are described by their type instead.
    """
    try:
        text = repr(value)
    except (ValueError, RecursionError, MemoryError):
        text = f"<a {type(value).__name__} too large to show>"
    except Exception as exc:  # a hostile __repr__
        text = f"<a {type(value).__name__} whose repr raised {type(exc).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class KVSpecError(Exception):
    """Root of every error kvspec raises on purpose."""


class ConfigError(KVSpecError, ValueError, TypeError):
    """A model was built with a field of the wrong type or value.

    The message names the class, the field, what was expected and what was found.
    """


class FieldError(ConfigError):
    """A message field failed validation; ``field`` names it, so the codec can say where (VER-1)."""

    def __init__(self, cls: type, field: str, expected: str, found: object) -> None:
        self.field = field
        super().__init__(f"{cls.__name__}.{field}: expected {expected}, got {shown(found)}")


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

    ``reason`` is a :class:`kvspec.FailureReason`, so that callers branch on it
    without parsing the message; every backend gives the same reason for the
    same event (docs/reference/transport.md, FAIL-1). A reason passed as its
    string value is converted; an unknown one is a :class:`ConfigError`.
    """

    def __init__(self, message: str, *, reason: FailureReason | str = FailureReason.TRANSFER_ERROR) -> None:
        try:
            self.reason: FailureReason = FailureReason(reason)
        except ValueError:
            raise ConfigError(
                f"TransportError.reason: expected one of {[r.value for r in FailureReason]}, got {reason!r}"
            ) from None
        super().__init__(message)


class OutOfBlocksError(KVSpecError, RuntimeError):
    """An allocator has fewer free blocks than a request needs; nothing was allocated."""


class UnknownRuleError(KVSpecError, KeyError):
    """A rule id that the specification does not define; the message lists the known ids."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; show the message as written.
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(KVSpecError, ImportError):
    """An optional backend's dependency is not installed; the message says how."""


def format_values(values: Sequence[object]) -> str:
    """Render a short, stable list of values for an error message."""
    shown = ", ".join(repr(v) for v in values[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"
