"""The kvspec error hierarchy: one root, each error also the builtin a caller would catch."""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence

from kvspec.core._enums import FailureReason

__all__ = [
    "AgentAuthError",
    "AgentRefusedError",
    "BackendUnavailableError",
    "BlockAlignmentError",
    "CacheAccountingError",
    "ConfigError",
    "FieldError",
    "GroupCountError",
    "IncompatiblePeerError",
    "IntegrityMismatchError",
    "KVSpecError",
    "LocalProtocolError",
    "MalformedMessageError",
    "OffloadingDisagreementError",
    "OutOfBlocksError",
    "PairKeyError",
    "ParallelismError",
    "PlanError",
    "ProtocolError",
    "RemoteError",
    "RemoteProtocolError",
    "StatePositionError",
    "StateSlotError",
    "TransportError",
    "UnknownRuleError",
    "UnsupportedHybridError",
    "UnsupportedVersionError",
    "WindowCoverageError",
    "WireError",
    "decode_error",
    "encode_error",
    "format_error",
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


class StatePositionError(BlockAlignmentError):
    """A state group's state has absorbed a different number of tokens than the consumer resumes at (STATE-1).

    A :class:`BlockAlignmentError`: the state sits at the wrong position, as a
    shifted block list does, and a request it ends fails with reason
    ``block_alignment`` (decision 100 in docs/explanation/decisions-state.md).
    """


class StateSlotError(BlockAlignmentError):
    """A state group's slot lists cannot give exactly one real slot per side (STATE-2, STATE-3)."""


class WindowCoverageError(KVSpecError, ValueError):
    """A block that covers a needed position is missing or null on one side (WIN-1)."""


class PlanError(KVSpecError, ValueError):
    """A block id or byte range falls outside the registered memory (PLAN-1)."""


class ParallelismError(KVSpecError, ValueError):
    """Two engines' parallel layouts cannot exchange a page (PAR-1 .. PAR-8).

    A size that does not divide, a layout that cannot be sliced, a layer no
    stage holds, or copies that do not tile a rank's page; the message names
    the field and the expected value.
    """


class IntegrityMismatchError(KVSpecError, ValueError):
    """What a consumer received differs from what the producer held: the request fails, never decodes (INT-3).

    ``rule`` names the rule that caught it (``INT-2`` for a digest, or the
    rule a block-list check raised), ``request_id`` the request and ``page``
    the first differing page (``"group g, tokens [a, b)"``, or ``None`` where
    the rule is not about a page). The message names all three; a peer's copy
    (:func:`decode_error`) keeps the message only.
    """

    def __init__(self, message: str, *, rule: str = "INT-2", request_id: str | None = None, page: str | None = None):
        self.rule = rule
        self.request_id = request_id
        self.page = page
        super().__init__(message)


class CacheAccountingError(KVSpecError, ValueError):
    """A cache the model keeps is neither exchanged nor declared ephemeral, or of an unknown kind (CACHE-1).

    The message names each cache (its name, kind and layers) or field, and what
    was expected.
    """


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


class OffloadingDisagreementError(BlockAlignmentError):
    """vLLM's offloading scheduler decided something kvspec's ``StoreSet`` or ``LoadSet`` cannot express (OFF-3, OFF-6).

    The message names what vLLM produced and which field of kvspec's model
    it does not fit; that is itself a finding of the offload audit. Re-exported
    by :mod:`kvspec.integrations.vllm`.
    """


class WireError(KVSpecError, ValueError):
    """A frame that is not a kvspec agent frame, or exceeds the receiver's limits; the connection is dropped.

    Re-exported by :mod:`kvspec.remote`.
    """


class AgentAuthError(KVSpecError, PermissionError):
    """The shared-secret handshake failed: wrong token, or a peer that is not a kvspec agent."""


class AgentRefusedError(KVSpecError, PermissionError):
    """The agent refused a request: memory, pool, agent or handle it does not own, a limit, or another client."""


class PairKeyError(KVSpecError, ValueError):
    """A peer's public value or nonce is malformed, or a proof does not verify (the torch workers' pair keys).

    Re-exported by :mod:`kvspec.transport._pairkey`.
    """


class RemoteError(TransportError):
    """An error of a class this side does not know, raised in another process (a worker, an agent server).

    ``type_name`` is the class name the other side gave; ``reason`` its
    :class:`kvspec.FailureReason` when it sent one. A :class:`TransportError`,
    so callers that catch a backend's failures catch it too.
    """

    def __init__(
        self, message: str, *, type_name: str, reason: FailureReason | str = FailureReason.TRANSFER_ERROR
    ) -> None:
        self.type_name = type_name
        super().__init__(message, reason=reason)


# Reply kinds of a worker's RequestError (the NIXL and Mooncake workers), and the class each becomes.
_REQUEST_KINDS: dict[str, type[KVSpecError]] = {
    "plan": PlanError,
    "config": ConfigError,
    "unavailable": BackendUnavailableError,
}


class RequestError(KVSpecError):
    """A request a transport worker process refuses; it crosses the pipe as :func:`encode_error` of :meth:`error`.

    ``kind`` is ``"plan"``, ``"config"``, ``"unavailable"`` or ``"transport"``;
    ``reason`` a :class:`kvspec.FailureReason` value (for ``"transport"``).
    Re-exported by :mod:`kvspec.transport._nixl_worker`, where the workers raise it.
    """

    def __init__(self, kind: str, message: str, reason: str = "transfer_error") -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = reason

    def error(self) -> KVSpecError:
        """The kvspec error this refusal is to the caller."""
        cls = _REQUEST_KINDS.get(self.kind)
        if cls is not None:
            return cls(str(self))
        try:
            return TransportError(str(self), reason=self.reason)
        except ConfigError:
            return TransportError(str(self))


def format_values(values: Sequence[object]) -> str:
    """Render a short, stable list of values for an error message."""
    shown = ", ".join(repr(v) for v in values[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"


# --------------------------------------------------------------------------- across process boundaries

# The most characters of an error message one process sends another (a worker's, an agent server's).
MAX_ERROR_MESSAGE = 4096
_MAX_TYPE_NAME = 64


def format_error(exc: BaseException) -> str:
    """``"ClassName: message"``, how reports and reproducers render an error."""
    return f"{type(exc).__name__}: {exc}"


def encode_error(exc: BaseException, *, message: str | None = None) -> dict[str, str]:
    """An error as plain strings another process can read: ``type``, ``message`` and, when it has one, ``reason``.

    The one error codec of kvspec's process boundaries (the NIXL and torch
    workers' pipes, the agent server's frames); :func:`decode_error` reads it.
    Nothing is pickled; ``message`` (default ``str(exc)``) is cut to
    :data:`MAX_ERROR_MESSAGE` characters.
    """
    body = {"type": type(exc).__name__[:_MAX_TYPE_NAME], "message": (str(exc) if message is None else message)}
    body["message"] = body["message"][:MAX_ERROR_MESSAGE]
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason in _REASONS:
        body["reason"] = FailureReason(reason).value
    return body


def decode_error(
    body: object, *, where: str = "", default_reason: FailureReason = FailureReason.TRANSFER_ERROR
) -> KVSpecError:
    """The kvspec error :func:`encode_error` wrote, as the same class where kvspec defines it.

    A class kvspec defines whose constructor takes just a message comes back
    as itself (a :class:`TransportError` with its reason); any other class (one
    built from fields, such as :class:`IncompatiblePeerError`, or no kvspec
    class), or a body that is not an encoded error, is a :class:`RemoteError` naming it,
    with the sent reason or ``default_reason``. ``where`` prefixes the message.
    Bounded: at most :data:`MAX_ERROR_MESSAGE` characters of the message are kept.
    """
    fields = body if isinstance(body, dict) else {}
    name = fields.get("type")
    name = name[:_MAX_TYPE_NAME] if isinstance(name, str) and name else "unknown error"
    text = fields.get("message")
    text = text[:MAX_ERROR_MESSAGE] if isinstance(text, str) else "no message"
    message = f"{where}: {text}" if where else text
    sent = fields.get("reason")
    reason = FailureReason(sent) if isinstance(sent, str) and sent in _REASONS else None
    cls = _ERROR_CLASSES.get(name)
    if cls is not None and issubclass(cls, TransportError):
        return TransportError(message, reason=reason or default_reason)
    if cls is not None:
        return cls(message)
    return RemoteError(message, type_name=name, reason=reason or default_reason)


_REASONS = frozenset(r.value for r in FailureReason)
# The classes above a peer may name and this side rebuilds from a message alone: those with the builtin
# constructor, MalformedMessageError and TransportError (rebuilt with its reason). The root, RemoteError,
# RequestError and the classes built from fields (FieldError, IncompatiblePeerError) come back as RemoteError.
_ERROR_CLASSES: dict[str, type[KVSpecError]] = {
    cls.__name__: cls
    for cls in globals().values()
    if isinstance(cls, type)
    and issubclass(cls, KVSpecError)
    and cls is not KVSpecError
    and (
        isinstance(cls.__init__, types.WrapperDescriptorType)
        or cls in (MalformedMessageError, TransportError, IntegrityMismatchError)
    )
}
