"""Protocol versions and the fields each minor adds: how a decoder reads a message of another minor, VER-1.

What must live here
-------------------

This module is VER-1's definition; the codec (:func:`kvspec.encode`,
:func:`kvspec.decode`) and :meth:`kvspec.TransferParams.from_kv_transfer_params`
only carry it out. It holds the protocol version (:data:`PROTOCOL_VERSION`), the
fields each minor version added (:data:`ADDED_FIELDS`, checked against the
message classes by :func:`check_added_fields`), which versions a side understands
(:func:`is_compatible_version`), and how a decoder reads one encoded object field
by field (:func:`decode_fields`): a field it does not know is ignored, an absent
field takes its default, an absent field without one is malformed.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence

from kvspec.core._errors import ConfigError, MalformedMessageError

__all__ = ["ADDED_FIELDS", "PROTOCOL_VERSION", "check_added_fields", "decode_fields", "is_compatible_version"]

PROTOCOL_VERSION: tuple[int, int] = (1, 3)
"""(major, minor) of the wire protocol; independent of the package version (VER-1)."""

ADDED_FIELDS: Mapping[tuple[int, int], Mapping[str, tuple[str, ...]]] = types.MappingProxyType(
    {
        # Where each list ends and the tokens C recomputes (ALIGN-1, WIN-1); the optional block digests (INT-1).
        (1, 1): {
            "TransferParams": ("producer_block_ends", "recomputed_tokens", "producer_block_digests"),
            "BlockOffer": ("consumer_block_ends",),
            "Completion": ("consumer_block_digests",),
        },
        # State groups: the tokens a state absorbed, the state profile, each state group's layout (STATE-1, STATE-5).
        (1, 2): {
            "TransferParams": ("state_tokens",),
            "EngineDescriptor": ("state_profile",),
            "GroupDescriptor": ("state_shapes", "state_dtypes", "mamba_type", "conv_layout"),
        },
        # The digest algorithms offered (INT-2), the parallel layout (PAR-9), the declared caches (CACHE-1).
        (1, 3): {"EngineDescriptor": ("digest_algorithms", "parallel", "caches")},
    }
)
"""Minor version -> message class -> the fields it added; every other field is 1.0's (VER-1).

A peer of an older minor omits them, and each field's default keeps that
minor's behaviour; a decoder of an older minor ignores them.
"""


def is_compatible_version(version: tuple[int, int]) -> bool:
    """True when this side understands a peer speaking ``version``: the same major, whatever the minor (VER-1)."""
    return version[0] == PROTOCOL_VERSION[0]


def decode_fields(
    data: Mapping[str, object],
    fields: Sequence[tuple[str, bool]],
    decode: Callable[[str, object], object],
    *,
    path: str = "",
) -> dict[str, object]:
    """The fields a decoder reads from one encoded object, each decoded by ``decode(name, value)`` (VER-1).

    ``fields`` lists, in order, each field the decoder knows and whether it has
    a default. A key it does not know is ignored (a newer minor added it); an
    absent field with a default is left out, so it takes its default (an older
    minor did not know it); an absent field without one raises
    :class:`kvspec.MalformedMessageError` naming it (``path.name``).
    """
    values: dict[str, object] = {}
    for name, has_default in fields:
        if name in data:
            values[name] = decode(name, data[name])
        elif not has_default:
            raise MalformedMessageError("missing", field=f"{path}.{name}" if path else name)
    return values


def check_added_fields(defaults: Mapping[str, Mapping[str, bool]]) -> None:
    """Raise ConfigError unless every field of :data:`ADDED_FIELDS` exists and has a default (VER-1).

    ``defaults`` maps each message class name to its fields, each to whether it
    has a default: a field a minor adds without one would make every older
    peer's message malformed, a major change.
    """
    for version, added in ADDED_FIELDS.items():
        for kind, names in added.items():
            for name in names:
                if not defaults.get(kind, {}).get(name, False):
                    raise ConfigError(
                        f"{kind}.{name}: added in protocol {version[0]}.{version[1]}, expected a field with a default"
                    )
