"""Functions the torch tests run inside a worker (``TorchAgent.call_in_worker``): a module light to import there."""

from __future__ import annotations

from typing import Any

__all__ = ["store_refusals"]


def store_refusals(worker: Any) -> list[str]:
    """In a worker: requests beyond the rendezvous store's bounds, as a hostile rank 1 would send them."""
    from kvspec.transport import _torch_worker as w  # here, not at the top: the test process never imports torch

    def fresh() -> Any:
        peer = w._Peer({"name": "peer", "uid": "b"}, "a")  # "a" < "b": this side is rank 0 and keeps the keys
        return w._ChannelStore(peer, 1.0)

    refusals = []
    big, store = fresh(), fresh()
    for index in range(w._STORE_TOTAL_BYTES // w._STORE_VALUE_BYTES):  # up to the total: accepted
        big.serve({"op": "store", "verb": "set", "keys": [f"k{index}"]}, bytes(w._STORE_VALUE_BYTES))
    for index in range(w._STORE_KEYS):
        store.serve({"op": "store", "verb": "set", "keys": [f"k{index}"]}, b"1")
    for ident in range(w._STORE_WAITS):  # waits for a key never set: parked, up to the bound
        store.serve({"op": "store", "verb": "wait", "keys": ["absent"], "id": ident}, b"")
    for target, header, payload in [
        (store, {"op": "store", "verb": "wait", "keys": ["absent"], "id": 99}, b""),
        (big, {"op": "store", "verb": "set", "keys": ["one-more"]}, b"x"),
        (store, {"op": "store", "verb": "set", "keys": ["one-more"]}, b"x"),
        (store, {"op": "store", "verb": "set", "keys": ["k0"]}, bytes(w._STORE_VALUE_BYTES + 1)),
        (store, {"op": "store", "verb": "set", "keys": ["k" * (w._STORE_KEY_CHARS + 1)]}, b""),
        (store, {"op": "store", "verb": "check", "keys": [f"k{i}" for i in range(17)]}, b""),
        (store, {"op": "store", "verb": "delete_key", "keys": ["k0"]}, b""),
        (store, {"op": "store", "verb": "add", "keys": ["k0"], "amount": 10**30}, b""),
    ]:
        try:
            target.serve(header, payload)
        except w._Failure as failure:
            refusals.append(failure.detail)
    return refusals
