"""JSON Schemas of the protocol messages, generated from the message classes (VER-1)."""

from kvspec.protocol._schema import message_schemas

__all__ = ["message_schemas"]
