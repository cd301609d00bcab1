"""INT-1: block digests, their wire form, and the driver's check on the exchange endpoints."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kvspec_conformance.configs import full, make_config

from kvspec import (
    BlockIds,
    BlockPairs,
    Completion,
    ConsumerSession,
    ConsumerState,
    EngineDescriptor,
    FailureInfo,
    FailureReason,
    FieldError,
    IncompatiblePeerError,
    KVCacheConfig,
    MalformedMessageError,
    PageDigester,
    TransferMode,
    TransferParams,
    decode,
    encode,
)
from kvspec.drivers._driver import CONSUMER, Driver, LiveRequest
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint, connect, run_request
from kvspec.presets import get_preset
from kvspec.spec.digest import DigestAlgorithm
from kvspec.spec.integrity import digest_block, new_block_hash
from kvspec.testing import PagePool, allocate_pool, fill_background, fill_producer_pages
from kvspec.transport import FaultInjector, FaultPlan, Transport
from kvspec.transport.loopback import LoopbackBackend

A = "0123456789abcdef" * 2
B = "fedcba9876543210" * 2
MODES = (TransferMode.READ, TransferMode.WRITE)


def _config(layout: str = "blocks_first", num_blocks: int = 40) -> KVCacheConfig:
    return get_preset("gemma-3-1b").build_config(
        num_blocks=num_blocks,
        layout=layout,  # type: ignore[arg-type]
        max_layers_per_group=2,
        head_size_divisor=64,
        block_size=16,
    )


def _pool(config: KVCacheConfig, seed: str) -> PagePool:
    pool = allocate_pool(config, shared=False)
    fill_background(pool, seed=seed)
    return pool


# --------------------------------------------------------------------------- the digest


def test_block_digest_is_blake2b_of_the_groups_pages_in_layer_order() -> None:
    """The spec's definition, computed by hand: BLAKE2b-128, person 'kvspec-INT-1', pages in layer order (INT-1)."""
    config = _config()
    pool = _pool(config, "p")
    digester = PageDigester(config, [r.buffer for r in pool.regions])
    for g, group in enumerate(config.kv_cache_groups):
        h = hashlib.blake2b(digest_size=16, person=b"kvspec-INT-1")
        for layer in group.layer_names:
            h.update(pool.page(layer, 5))
        assert digester.block_digest(g, 5) == h.hexdigest()
        assert digester.block_digest(g, 0) == ""  # the null block (NULL-1)


@pytest.mark.parametrize("algorithm", list(DigestAlgorithm))
@pytest.mark.parametrize("layout", ["blocks_first", "layers_first", "per_layer"])
def test_the_digester_computes_the_spec_definition(layout: str, algorithm: DigestAlgorithm) -> None:
    """PageDigester walks its layout once; its digests equal kvspec.spec.integrity.digest_block's (INT-1)."""
    config = _config(layout, num_blocks=8)
    pool = _pool(config, "d")
    buffers = [r.buffer for r in pool.regions]
    digester = PageDigester(config, buffers, algorithm)
    for g in range(config.num_groups):
        for block in range(8):
            assert digester.block_digest(g, block) == digest_block(config, buffers, g, block, algorithm)


def test_the_block_digest_known_answer() -> None:
    """The spec page's known answer: two layers of 16-byte pages holding 0x00..0x1f (INT-1)."""
    hasher = new_block_hash(DigestAlgorithm.BLAKE2B_128)
    hasher.update(bytes(range(16)))
    hasher.update(bytes(range(16, 32)))
    assert hasher.hexdigest() == "d92742a8ed9b60c8be14ed5367c23de2"


@given(
    layout=st.sampled_from(["layers_first", "per_layer"]),
    block=st.integers(min_value=1, max_value=39),
    flip=st.integers(min_value=0, max_value=10**6),
)
@example(layout="layers_first", block=1, flip=0)
@example(layout="per_layer", block=39, flip=10**6)
def test_same_kv_same_digest_across_layouts_and_any_changed_byte_shows(layout: str, block: int, flip: int) -> None:
    """Two layouts holding the same pages agree; one byte changed anywhere in the block's pages disagrees (INT-1)."""
    left_config, right_config = _config("blocks_first"), _config(layout)
    with allocate_pool(left_config, shared=False) as left, allocate_pool(right_config, shared=False) as right:
        fill_background(left, seed="l")
        fill_background(right, seed="r")
        ids = BlockIds([[block]] * left_config.num_groups)
        fill_producer_pages(left, ids, num_tokens=16, salt="same")
        fill_producer_pages(right, ids, num_tokens=16, salt="same")
        lhs = PageDigester(left_config, [r.buffer for r in left.regions])
        rhs = PageDigester(right_config, [r.buffer for r in right.regions])
        assert lhs.digests(ids) == rhs.digests(ids)
        group = flip % right_config.num_groups
        layers = right_config.kv_cache_groups[group].layer_names
        page = right.page(layers[flip % len(layers)], block)
        page[flip % len(page)] ^= 0x01
        assert lhs.block_digest(group, block) != rhs.block_digest(group, block)
        other = (group + 1) % right_config.num_groups
        assert lhs.block_digest(other, block) == rhs.block_digest(other, block)


def test_read_and_write_checks_name_exactly_the_bad_consumer_blocks() -> None:
    config = _config()
    with allocate_pool(config, shared=False) as p_pool, allocate_pool(config, shared=False) as c_pool:
        fill_background(p_pool, seed="p")
        fill_background(c_pool, seed="c")
        pairs = BlockPairs(producer_block_ids=BlockIds([[3, 4], [5]]), consumer_block_ids=BlockIds([[7, 8], [9]]))
        for g, (p_ids, c_ids) in enumerate(zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)):
            for p, c in zip(p_ids, c_ids, strict=True):
                for layer in config.kv_cache_groups[g].layer_names:
                    c_pool.page(layer, c)[:] = p_pool.page(layer, p)
        sender = PageDigester(config, [r.buffer for r in p_pool.regions])
        receiver = PageDigester(config, [r.buffer for r in c_pool.regions])
        advertised = BlockIds([[0, 3, 4], [5]])
        assert receiver.check_read(pairs, advertised, sender.digests(advertised)) == BlockIds([[], []])
        offer = BlockIds([[7, 8, 0], [9]])
        written = sender.written_digests(pairs, offer)
        assert written[0][2] == ""
        assert written[1][0] != ""
        assert receiver.check_written(offer, written) == BlockIds([[], []])
        c_pool.page(config.kv_cache_groups[0].layer_names[-1], 8)[3] ^= 0xFF
        assert receiver.check_read(pairs, advertised, sender.digests(advertised)) == BlockIds([[8], []])
        assert receiver.check_written(offer, written) == BlockIds([[8], []])
        # A producer block with no digest cannot be vouched for; a digest list of another shape fails all.
        blank = (("", "", sender.block_digest(0, 4)), (sender.block_digest(1, 5),))
        assert receiver.check_read(pairs, advertised, blank) == BlockIds([[7, 8], []])
        assert receiver.check_written(offer, written[:1]) == BlockIds([[7, 8], [9]])


# --------------------------------------------------------------------------- the wire


def test_digests_travel_through_the_codec_and_the_vllm_dict() -> None:
    params = TransferParams(
        request_id="r",
        producer_engine_id="P",
        producer_block_ids=[[0, 4], [6]],
        num_tokens=20,
        mode=TransferMode.READ,
        lease_deadline=5.0,
        producer_block_digests=[["", A], [B]],
    )
    assert decode(encode(params)) == params
    as_dict = params.to_kv_transfer_params()
    assert as_dict["kvspec_block_digests"] == [["", A], [B]]
    assert TransferParams.from_kv_transfer_params(as_dict) == params
    plain = attrs.evolve(params, producer_block_digests=None)
    assert "kvspec_block_digests" not in plain.to_kv_transfer_params()  # a 1.1 dict without INT-1 is unchanged
    completion = Completion(request_id="r", producer_engine_id="P", consumer_block_digests=[[A, ""]])
    assert decode(encode(completion)) == completion


@pytest.mark.parametrize(
    ("digests", "field"),
    [
        ([[A, A], [B]], r"producer_block_digests\[0\]\[0\]"),  # a digest for the null block
        ([["", ""], [B]], r"producer_block_digests\[0\]\[1\]"),  # none for a real block
        ([["", A]], r"producer_block_digests"),  # one group short
        ([["", A.upper()], [B]], r"producer_block_digests\[0\]\[1\]"),  # not lowercase hex
    ],
)
def test_malformed_param_digests_are_refused_naming_the_field(digests: list[list[str]], field: str) -> None:
    with pytest.raises(FieldError, match=field):
        TransferParams(
            request_id="r",
            producer_engine_id="P",
            producer_block_ids=[[0, 4], [6]],
            num_tokens=20,
            mode=TransferMode.READ,
            lease_deadline=5.0,
            producer_block_digests=digests,
        )


def test_malformed_dict_and_completion_digests_are_refused() -> None:
    good = TransferParams(
        request_id="r",
        producer_engine_id="P",
        producer_block_ids=[[4]],
        num_tokens=4,
        mode=TransferMode.READ,
        lease_deadline=5.0,
        producer_block_digests=[[A]],
    ).to_kv_transfer_params()
    with pytest.raises(MalformedMessageError, match=r"kvspec_block_digests\[0\]\[0\]"):
        TransferParams.from_kv_transfer_params({**good, "kvspec_block_digests": [["xyz"]]})
    with pytest.raises(MalformedMessageError, match="kvspec_block_digests"):
        TransferParams.from_kv_transfer_params({**good, "kvspec_block_digests": A})
    with pytest.raises(FieldError, match=r"consumer_block_digests\[0\]\[0\]"):
        Completion(request_id="r", producer_engine_id="P", consumer_block_digests=[[A[:-1]]])


# --------------------------------------------------------------------------- the driver, on the endpoints


@attrs.define
class _Pair:
    producer: ProducerEndpoint
    consumer: ConsumerEndpoint
    p_pool: PagePool
    c_pool: PagePool


@pytest.fixture
def pair_factory() -> Iterator[object]:
    made: list[tuple[LoopbackBackend, PagePool, PagePool]] = []

    def make(mode: TransferMode, *, producer_integrity: bool, consumer_integrity: bool, corrupt: bool = False) -> _Pair:
        backend = LoopbackBackend()
        config = _config(num_blocks=80)
        p_pool, c_pool = _pool(config, "p"), _pool(config, "c")
        p_agent: Transport = backend.create_agent("producer")
        c_agent: Transport = backend.create_agent("consumer")
        if corrupt:
            injected = FaultInjector(p_agent if mode is TransferMode.WRITE else c_agent, FaultPlan(corrupt_page=1.0))
            p_agent, c_agent = (injected, c_agent) if mode is TransferMode.WRITE else (p_agent, injected)
        producer = ProducerEndpoint(
            engine_id="P",
            config=config,
            transport=p_agent,
            regions=p_pool.regions,
            mode=mode,
            integrity=producer_integrity,
        )
        consumer = ConsumerEndpoint(
            engine_id="C",
            config=config,
            transport=c_agent,
            regions=c_pool.regions,
            mode=mode,
            integrity=consumer_integrity,
        )
        connect(producer, consumer)
        made.append((backend, p_pool, c_pool))
        return _Pair(producer, consumer, p_pool, c_pool)

    yield make
    for backend, p_pool, c_pool in made:
        backend.close()
        p_pool.close()
        c_pool.close()


def _run(
    pair: _Pair, request_id: str = "r1", num_tokens: int = 70, hit: int = 0
) -> tuple[ConsumerState, FailureInfo | None]:
    def fill(ids: BlockIds) -> None:
        fill_producer_pages(pair.p_pool, ids, num_tokens=num_tokens, salt=request_id)

    result = run_request(
        pair.producer, pair.consumer, request_id=request_id, num_tokens=num_tokens, prefix_hit_tokens=hit, fill=fill
    )
    return result.state, result.consumer.failure


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_integrity_on_loads_intact_transfers(pair_factory: object, mode: TransferMode) -> None:
    pair = pair_factory(mode, producer_integrity=True, consumer_integrity=True)  # type: ignore[operator]
    for i, (tokens, hit) in enumerate([(70, 0), (33, 16), (64, 64), (16, 0)]):
        state, failure = _run(pair, f"r{i}", tokens, hit)
        assert state is ConsumerState.LOADED, failure


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_corrupted_transfer_fails_integrity_never_loaded(pair_factory: object, mode: TransferMode) -> None:
    pair = pair_factory(mode, producer_integrity=True, consumer_integrity=True, corrupt=True)  # type: ignore[operator]
    state, failure = _run(pair)
    assert state is ConsumerState.FAILED
    assert failure is not None
    assert failure.reason is FailureReason.INTEGRITY, failure
    assert "INT-1" in failure.detail
    assert pair.producer.active_requests == ()
    assert pair.consumer.active_requests == ()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_receiver_with_integrity_refuses_a_sender_without_digests(pair_factory: object, mode: TransferMode) -> None:
    pair = pair_factory(mode, producer_integrity=False, consumer_integrity=True)  # type: ignore[operator]
    state, failure = _run(pair)
    assert state is ConsumerState.FAILED
    assert failure is not None
    assert failure.reason is FailureReason.INTEGRITY
    assert "no block digests" in failure.detail


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_receiver_without_integrity_ignores_digests(pair_factory: object, mode: TransferMode) -> None:
    pair = pair_factory(mode, producer_integrity=True, consumer_integrity=False)  # type: ignore[operator]
    state, failure = _run(pair)
    assert state is ConsumerState.LOADED, failure


def test_the_specs_known_answer() -> None:
    """The digest docs/spec/protocol-lifecycle.md gives for two 16-byte pages 0x00..0x1f, through PageDigester."""
    config = make_config(full(4), num_blocks=4, layers=2)
    group = config.kv_cache_groups[0]
    assert group.kv_cache_spec.page_size_bytes == 16
    with allocate_pool(config, shared=False) as pool:
        for index, layer in enumerate(group.layer_names):
            pool.page(layer, 1)[:] = bytes(range(16 * index, 16 * index + 16))
        digest = PageDigester(config, [r.buffer for r in pool.regions]).block_digest(0, 1)
    spec = (Path(__file__).resolve().parents[1] / "docs" / "spec" / "protocol-lifecycle.md").read_text()
    assert f"`{digest}`" in spec
    assert digest == "d92742a8ed9b60c8be14ed5367c23de2"


def test_only_a_loading_consumer_checks_a_completion() -> None:
    """A Completion that cannot load the request (not yet started) is left to the table, never failed on digests."""
    config = make_config(full(4), num_blocks=8)
    backend = LoopbackBackend()
    try:
        producer_agent, consumer_agent = backend.create_agent("producer"), backend.create_agent("consumer")
        to_consumer = producer_agent.add_remote_agent(consumer_agent.get_agent_metadata())
        consumer_agent.add_remote_agent(producer_agent.get_agent_metadata())
        with allocate_pool(config, shared=False) as pool:
            digester = PageDigester(config, [r.buffer for r in pool.regions])
            driver = Driver(
                role=CONSUMER,
                transport=consumer_agent,
                clock=lambda: 1.0,
                on_free=lambda request, ids: None,
                on_end=lambda request: None,
                integrity=digester,
            )
            params = TransferParams(
                request_id="r",
                producer_engine_id="P",
                producer_block_ids=[[1]],
                num_tokens=4,
                mode=TransferMode.WRITE,
                lease_deadline=50.0,
            )
            session = ConsumerSession(params=params, consumer_engine_id="C", consumer_block_ids=[[2]])
            driver.add(LiveRequest(session=session, peer="producer"))
            wrong = Completion(request_id="r", producer_engine_id="P", consumer_block_digests=[[A]])
            producer_agent.send_notification(to_consumer, encode(wrong))
            driver.poll()
            assert session.state.value == "allocated"  # ignored, as without integrity (SM-2)
            driver.execute(driver.requests["r"], session.start(now=1.0))
            producer_agent.send_notification(to_consumer, encode(wrong))
            driver.poll()
            assert session.state is ConsumerState.FAILED
            assert session.failure is not None
            assert session.failure.reason is FailureReason.INTEGRITY
            assert session.failure.failed_consumer_block_ids == BlockIds([[2]])
    finally:
        backend.close()


# --------------------------------------------------------------------------- INT-2: the algorithm, chosen at handshake


def test_two_1_3_peers_choose_xxh3_and_load_intact_transfers(pair_factory: object) -> None:
    pair = pair_factory(TransferMode.READ, producer_integrity=True, consumer_integrity=True)  # type: ignore[operator]
    for endpoint in (pair.producer, pair.consumer):
        assert endpoint.driver.integrity.algorithm is DigestAlgorithm.XXH3_128
    assert _run(pair) == (ConsumerState.LOADED, None)


def test_a_1_2_peer_keeps_blake2b_and_a_peer_without_a_common_algorithm_is_refused() -> None:
    config = _config()
    with _pool(config, "p") as pool:
        digester = PageDigester(config, [r.buffer for r in pool.regions])
        digester.choose("old", ["xxh3-128", "blake2b-128"], [], peer_version=(1, 2))
        assert digester.algorithm is DigestAlgorithm.BLAKE2B_128
        # The same engine cannot then digest another peer's blocks with XXH3: one algorithm per digester.
        with pytest.raises(IncompatiblePeerError, match="digest_algorithms"):
            digester.choose("new", ["xxh3-128"], ["xxh3-128"], peer_version=(1, 3))
        fresh = PageDigester(config, [r.buffer for r in pool.regions])
        with pytest.raises(IncompatiblePeerError, match="digest_algorithms"):
            fresh.choose("odd", ["xxh3-128", "blake2b-128"], ["crc32"], peer_version=(1, 3))
        fresh.choose("new", ["xxh3-128", "blake2b-128"], ["blake2b-128", "xxh3-128"], peer_version=(1, 3))
        assert fresh.algorithm is DigestAlgorithm.XXH3_128  # kvspec's order, not the peer's
        assert fresh.block_digest(0, 5) != digester.block_digest(0, 5)


@pytest.mark.parametrize("bad", [("x" * 33,), ("a",) * 9, ("",), (5,)])
def test_a_peers_algorithm_list_is_bounded(bad: tuple[object, ...]) -> None:
    descriptor = EngineDescriptor.from_config(engine_id="P", config=_config(), mode=TransferMode.READ, hma_enabled=True)
    body = json.loads(encode(descriptor)) | {"digest_algorithms": list(bad)}
    with pytest.raises(MalformedMessageError, match="digest_algorithms"):
        decode(json.dumps(body).encode())
