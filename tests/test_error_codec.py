"""One error codec across kvspec's process boundaries: plain strings, bounded, the same class back (issue 24).

The NIXL worker's pipe, the torch worker's pipe and the agent server's frames
all carry :func:`kvspec.encode_error` dicts and read them with
:func:`kvspec.decode_error`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvspec import (
    BlockAlignmentError,
    ConfigError,
    FailureReason,
    IncompatiblePeerError,
    KVSpecError,
    MalformedMessageError,
    PlanError,
    RemoteError,
    TransportError,
    UnknownRuleError,
    decode_error,
    encode_error,
    format_error,
)
from kvspec.core._errors import _ERROR_CLASSES, MAX_ERROR_MESSAGE, RequestError
from kvspec.remote import _client, _server
from kvspec.transport import _nixl_worker


@pytest.mark.parametrize("cls", [_ERROR_CLASSES[n] for n in sorted(_ERROR_CLASSES)], ids=sorted(_ERROR_CLASSES))
def test_every_kvspec_class_comes_back_as_itself(cls: type[KVSpecError]) -> None:
    body = json.loads(json.dumps(encode_error(cls("what went wrong"))))  # plain JSON: nothing pickled
    back = decode_error(body, where="agent 'p'")
    assert type(back) is cls
    assert str(back) == "agent 'p': what went wrong" or isinstance(back, UnknownRuleError)


def test_a_transport_error_keeps_its_reason() -> None:
    back = decode_error(encode_error(TransportError("gone", reason=FailureReason.PEER_DISCONNECTED)))
    assert type(back) is TransportError
    assert back.reason is FailureReason.PEER_DISCONNECTED


@pytest.mark.parametrize(
    "body",
    [
        {"type": "ZeroDivisionError", "message": "division by zero"},  # not a kvspec class
        {"type": "IncompatiblePeerError", "message": "ab"},  # built from fields, not from a message
        {"type": "FieldError", "message": "x"},
        {"type": "KVSpecError", "message": "the root"},
        {"type": "RemoteError", "message": "again"},
    ],
)
def test_a_class_this_side_cannot_rebuild_is_a_named_remote_error(body: dict[str, str]) -> None:
    back = decode_error(body, default_reason=FailureReason.POST_FAILED)
    assert isinstance(back, RemoteError)
    assert isinstance(back, TransportError)  # callers that catch a backend's failures catch it
    assert (back.type_name, back.reason, str(back)) == (body["type"], FailureReason.POST_FAILED, body["message"])


@pytest.mark.parametrize("body", [None, "TransportError: x", [], {"type": 3, "message": None, "reason": "nope"}])
def test_a_body_that_is_not_an_encoded_error_is_a_remote_error(body: object) -> None:
    back = decode_error(body)
    assert isinstance(back, RemoteError)
    assert back.reason is FailureReason.TRANSFER_ERROR


def test_messages_and_names_are_bounded_both_ways() -> None:
    big = "x" * (MAX_ERROR_MESSAGE * 100)
    assert len(encode_error(PlanError(big))["message"]) == MAX_ERROR_MESSAGE
    back = decode_error({"type": "y" * 10_000, "message": big})
    assert isinstance(back, RemoteError)
    assert len(str(back)) == MAX_ERROR_MESSAGE
    assert len(back.type_name) <= 64


def test_format_error_is_class_and_message() -> None:
    assert format_error(BlockAlignmentError("3 > 2")) == "BlockAlignmentError: 3 > 2"


# --------------------------------------------------------------------------- the three boundaries


@pytest.mark.parametrize(
    ("kind", "reason", "expected"),
    [
        (_nixl_worker.PLAN, "transfer_error", PlanError),
        (_nixl_worker.CONFIG, "transfer_error", ConfigError),
        (_nixl_worker.TRANSPORT, "peer_disconnected", TransportError),
    ],
)
def test_the_nixl_worker_replies_with_the_codec(kind: str, reason: str, expected: type[KVSpecError]) -> None:
    def refuse() -> None:
        raise RequestError(kind, "refused", reason)

    worker = cast(Any, SimpleNamespace(ops={"refuse": refuse}, label="NIXL"))
    status, body = _nixl_worker.answer(worker, "refuse", [])
    assert status == "err"
    back = decode_error(json.loads(json.dumps(body)))
    assert type(back) is expected
    if isinstance(back, TransportError):
        assert back.reason is FailureReason(reason)


def test_a_bug_in_the_nixl_worker_is_a_transport_error() -> None:
    def broken() -> None:
        raise ZeroDivisionError("oops")

    _, body = _nixl_worker.answer(cast(Any, SimpleNamespace(ops={"broken": broken}, label="NIXL")), "broken", [])
    back = decode_error(body)
    assert type(back) is TransportError
    assert "ZeroDivisionError: oops" in str(back)


@pytest.mark.parametrize(
    "error",
    [
        PlanError("block 9"),
        TransportError("late", reason=FailureReason.TIMEOUT),
        MalformedMessageError("bad", field="f"),
    ],
)
def test_the_agent_server_and_client_share_the_codec(error: KVSpecError) -> None:
    reply = json.loads(json.dumps(_server._error(error)))
    back = _client._remote_error(reply, "agent server op")
    assert type(back) is type(error)
    assert str(back) == f"agent server op: {error}"
    assert getattr(back, "reason", None) == getattr(error, "reason", None)


def test_a_hostile_server_naming_a_field_built_class_gets_a_clear_error() -> None:
    # Before the codec the client called IncompatiblePeerError("ab"), which raised a bare ValueError.
    reply = {"ok": False, "error": {"type": "IncompatiblePeerError", "message": "ab"}}
    back = _client._remote_error(reply, "agent server hello")
    assert isinstance(back, RemoteError)
    assert back.type_name == "IncompatiblePeerError"
    assert not isinstance(back, IncompatiblePeerError)
