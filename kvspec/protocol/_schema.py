"""JSON Schema of every protocol message, generated from the message classes through the codec (VER-1).

``python -m kvspec.protocol._schema DIR`` (or :func:`dump_schemas`) writes one
``<type>.schema.json`` per message; ``docs/schema/`` holds the committed copy
and a test keeps it current.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvspec.protocol._codec import MESSAGE_TYPES, field_codec
from kvspec.reference._messages import PROTOCOL_VERSION

__all__ = ["SCHEMA_DIALECT", "dump_schemas", "message_schema", "message_schemas", "render_schema"]

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def message_schema(type_name: str) -> dict[str, Any]:
    """The JSON Schema of one encoded message, by its wire ``"type"`` name (VER-1).

    Unknown properties are allowed: a newer minor may add fields, which an
    older reader ignores.
    """
    cls: Any = MESSAGE_TYPES[type_name]
    body = field_codec(cls).schema()
    summary = (cls.__doc__ or "").strip().splitlines()[0]
    major = PROTOCOL_VERSION[0]
    properties = {
        "type": {"const": type_name},
        "v": {
            "type": "array",
            "prefixItems": [{"const": major}, {"type": "integer", "minimum": 0}],
            "minItems": 2,
            "maxItems": 2,
            "description": "[major, minor] protocol version",
        },
        **body["properties"],
    }
    return {
        "$schema": SCHEMA_DIALECT,
        "title": cls.__name__,
        "description": summary,
        "type": "object",
        "properties": properties,
        "required": ["type", "v", *body["required"]],
        "additionalProperties": True,
    }


def message_schemas() -> dict[str, dict[str, Any]]:
    """Every message's schema, by wire ``"type"`` name."""
    return {name: message_schema(name) for name in MESSAGE_TYPES}


def render_schema(type_name: str) -> str:
    """One schema as the stable JSON text that is committed (sorted keys, two-space indent)."""
    return json.dumps(message_schema(type_name), indent=2, sort_keys=True) + "\n"


def dump_schemas(directory: str | Path) -> list[Path]:
    """Write ``<type>.schema.json`` for every message into ``directory``; return the paths written."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in MESSAGE_TYPES:
        path = folder / f"{name}.schema.json"
        path.write_text(render_schema(name), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    for written_path in dump_schemas(sys.argv[1] if len(sys.argv) > 1 else "docs/schema"):
        print(written_path)
