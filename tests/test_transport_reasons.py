"""Every backend gives the same error and reason for the same event (FAIL-1, PLAN-1).

One agent pair per backend; each event is raised on each backend and the
reason compared with the one table in docs/reference/transport.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from conftest import require_backend_module
from strategies import config_from_specs

from kvspec import (
    FailureReason,
    FullAttentionSpec,
    KVCacheConfig,
    PlanError,
    TransferMode,
    TransportError,
)
from kvspec.testing import PagePool, allocate_pool
from kvspec.transport import Backend, Descriptor, MemoryRegion, TransferHandle, Transport, load_backend

BACKENDS = ["loopback", "torch", "nixl"]


def _config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    return config_from_specs([spec], num_blocks=4)


class Pair:
    """A producer and a consumer agent of one backend, each with a one-region pool."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        config = _config()
        self.pools: list[PagePool] = [allocate_pool(config), allocate_pool(config)]
        self.producer = backend.create_agent("producer")
        self.consumer = backend.create_agent("consumer")
        self.producer.register_memory(self.pools[0].regions)
        self.consumer.register_memory(self.pools[1].regions)
        self.consumer.add_remote_agent(self.producer.get_agent_metadata())
        self.producer.add_remote_agent(self.consumer.get_agent_metadata())
        self.region_size = self.pools[0].regions[0].nbytes

    def close(self) -> None:
        self.backend.close()
        for pool in self.pools:
            pool.close()


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest, pytestconfig: pytest.Config) -> Iterator[Pair]:
    name: str = request.param
    if name == "torch":
        require_backend_module(pytestconfig, "torch")
    if name == "nixl":
        require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    options: dict[str, object] = {"in_process": "consumer"} if name == "nixl" else {}
    built = Pair(load_backend(name, **options))
    yield built
    built.close()


def _reason_of(call: Callable[[], object]) -> FailureReason:
    with pytest.raises(TransportError, match=r"agent 'closing' is closed") as info:
        call()
    return info.value.reason


def test_an_unknown_peer_is_peer_disconnected(pair: Pair) -> None:
    d = [Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=16)]
    with pytest.raises(TransportError, match=r"unknown or disconnected peer 'nobody'") as info:
        pair.consumer.post(TransferMode.READ, d, peer="nobody")
    assert info.value.reason is FailureReason.PEER_DISCONNECTED


def test_a_foreign_handle_is_a_protocol_error(pair: Pair) -> None:
    handle = TransferHandle(transfer_id=987654, peer="producer", mode=TransferMode.READ)
    with pytest.raises(TransportError, match=r"unknown or released handle 987654") as info:
        pair.consumer.check(handle)
    assert info.value.reason is FailureReason.PROTOCOL


def test_foreign_metadata_is_a_protocol_error(pair: Pair) -> None:
    with pytest.raises(TransportError, match=r"peer metadata") as info:
        pair.consumer.add_remote_agent(b"not metadata of any backend")
    assert info.value.reason is FailureReason.PROTOCOL


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((0, 0, 0, 0, 0), r"descriptor 0: expected nbytes > 0, got 0"),
        ((3, 0, 0, 0, 16), r"descriptor 0: local region 3 is not registered \(1 regions\)"),
        ((0, 0, 0, -16, 16), r"descriptor 0: remote bytes \[-16, 0\) fall outside region 0 of \d+ bytes"),
    ],
)
def test_a_descriptor_outside_the_regions_is_one_plan_error(
    pair: Pair, fields: tuple[int, int, int, int, int], message: str
) -> None:
    lr, lo, rr, ro, n = fields
    good = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=16)
    bad = Descriptor(local_region=lr, local_offset=lo, remote_region=rr, remote_offset=ro, nbytes=n)
    with pytest.raises(PlanError, match=message.replace("descriptor 0", "descriptor 1")):
        pair.consumer.post(TransferMode.READ, [good, bad], peer="producer")


def test_a_range_past_the_end_names_the_region_size(pair: Pair) -> None:
    size = pair.region_size
    bad = Descriptor(local_region=0, local_offset=size - 8, remote_region=0, remote_offset=0, nbytes=16)
    expected = re.escape(f"descriptor 0: local bytes [{size - 8}, {size + 8}) fall outside region 0 of {size} bytes")
    with pytest.raises(PlanError, match=expected):
        pair.consumer.post(TransferMode.WRITE, [bad], peer="producer")


def test_every_call_on_a_closed_agent_is_peer_disconnected(pair: Pair) -> None:
    agent: Transport = pair.backend.create_agent("closing")
    agent.close()
    d = [Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=16)]
    handle = TransferHandle(transfer_id=1, peer="producer", mode=TransferMode.READ)
    calls = {
        "register_memory": lambda: agent.register_memory(list[MemoryRegion]()),
        "get_agent_metadata": agent.get_agent_metadata,
        "post": lambda: agent.post(TransferMode.READ, d, peer="producer"),
        "check": lambda: agent.check(handle),
        "send_notification": lambda: agent.send_notification("producer", b"x"),
        "get_notifications": agent.get_notifications,
    }
    reasons = {name: _reason_of(call) for name, call in calls.items()}
    assert reasons == dict.fromkeys(calls, FailureReason.PEER_DISCONNECTED)
