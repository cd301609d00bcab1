"""End-to-end exchange on the loopback backend: READ and WRITE over model presets, checked by the page oracle."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import attrs
import pytest

from kvspec import (
    BlockIds,
    ConsumerState,
    FailureReason,
    IncompatiblePeerError,
    KVCacheConfig,
    LocalProtocolError,
    MambaSpec,
    OutOfBlocksError,
    ProducerState,
    TransferMode,
    TransferParams,
    UnsupportedHybridError,
)
from kvspec.exchange import BlockAllocator, ConsumerEndpoint, ProducerEndpoint, connect, run_request
from kvspec.presets import get_preset
from kvspec.testing import (
    ExpectedLoad,
    PagePool,
    allocate_pool,
    check_pools,
    fill_background,
    fill_producer_pages,
    format_mismatches,
)
from kvspec.transport.loopback import LoopbackBackend

MODES = (TransferMode.READ, TransferMode.WRITE)
# Hybrid presets (SW + full), one full-attention-only and one MLA preset.
MODELS = ("gemma-3-1b", "gemma-3-27b", "gpt-oss-20b", "gemma-4-31b", "llama-3.1-8b", "deepseek-v2-lite")


class SteppingClock:
    """A clock that advances a fixed step on every read, so deadlines pass without sleeping."""

    def __init__(self, step: float = 0.001) -> None:
        self.now = 1000.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def small_config(model: str, num_blocks: int, layout: str = "blocks_first", block_size: int = 16) -> KVCacheConfig:
    return get_preset(model).build_config(
        num_blocks=num_blocks,
        layout=layout,  # type: ignore[arg-type]
        max_layers_per_group=2,
        head_size_divisor=64,
        block_size=block_size,
    )


@attrs.define
class Pair:
    producer: ProducerEndpoint
    consumer: ConsumerEndpoint
    producer_pool: PagePool
    consumer_pool: PagePool
    backend: LoopbackBackend


@pytest.fixture
def make_pair() -> Iterator[object]:
    made: list[Pair] = []

    def make(
        model: str,
        mode: TransferMode,
        *,
        num_blocks: int = 160,
        consumer_layout: str = "blocks_first",
        clock: SteppingClock | None = None,
        lease: float = 5.0,
    ) -> Pair:
        producer_config = small_config(model, num_blocks)
        consumer_config = small_config(model, num_blocks + 7, consumer_layout)
        backend = LoopbackBackend()
        producer_pool = allocate_pool(producer_config, shared=False)
        consumer_pool = allocate_pool(consumer_config, shared=False)
        fill_background(producer_pool, seed="producer")
        fill_background(consumer_pool, seed="consumer")
        tick = clock or SteppingClock()
        producer = ProducerEndpoint(
            engine_id="P",
            config=producer_config,
            transport=backend.create_agent("producer"),
            regions=producer_pool.regions,
            mode=mode,
            clock=tick,
            lease_duration=lease,
            release_grace=1.0,
            drain_timeout=0.5,
        )
        consumer = ConsumerEndpoint(
            engine_id="C",
            config=consumer_config,
            transport=backend.create_agent("consumer"),
            regions=consumer_pool.regions,
            mode=mode,
            clock=tick,
            drain_timeout=0.5,
        )
        connect(producer, consumer)
        pair = Pair(producer, consumer, producer_pool, consumer_pool, backend)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.backend.close()
        pair.producer_pool.close()
        pair.consumer_pool.close()


def run_and_check(pair: Pair, request_id: str, num_tokens: int, prefix_hit: int = 0) -> ConsumerState:
    producer_free, consumer_free = pair.producer.num_free_blocks, pair.consumer.num_free_blocks
    consumer_before = pair.consumer_pool.snapshot()
    snapshots = []

    def fill(ids: BlockIds) -> None:
        fill_producer_pages(pair.producer_pool, ids, num_tokens=num_tokens, salt=request_id)
        snapshots.append(pair.producer_pool.snapshot())

    result = run_request(
        pair.producer,
        pair.consumer,
        request_id=request_id,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit,
        fill=fill,
    )
    load = ExpectedLoad(
        producer_block_ids=result.consumer.producer_block_ids,
        consumer_block_ids=result.consumer.consumer_block_ids,
        num_tokens=num_tokens,
        salt=request_id,
        loaded=result.state is ConsumerState.LOADED,
    )
    mismatches = check_pools(
        producer=pair.producer_pool,
        consumer=pair.consumer_pool,
        producer_before=snapshots[0],
        consumer_before=consumer_before,
        loads=[load],
    )
    assert not mismatches, format_mismatches(mismatches)
    assert pair.producer.num_free_blocks == producer_free
    assert pair.consumer.num_free_blocks == consumer_free
    assert pair.producer.active_requests == ()
    assert pair.consumer.active_requests == ()
    return result.state


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("model", MODELS)
def test_end_to_end_byte_exact(make_pair: object, model: str, mode: TransferMode) -> None:
    """Paired pages equal the producer's, all else untouched, free counts back to baseline (DONE-1, PLAN-1)."""
    pair = make_pair(model, mode)  # type: ignore[operator]
    for i, (tokens, hit) in enumerate([(100, 0), (37, 32), (160, 64), (16, 0)]):
        assert run_and_check(pair, f"r{i}", tokens, hit) is ConsumerState.LOADED


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("consumer_layout", ["layers_first", "per_layer"])
def test_different_layouts_on_each_side(make_pair: object, mode: TransferMode, consumer_layout: str) -> None:
    pair = make_pair("gpt-oss-20b", mode, consumer_layout=consumer_layout)  # type: ignore[operator]
    assert run_and_check(pair, "r", 200, 32) is ConsumerState.LOADED


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_full_prefix_hit_is_release_only(make_pair: object, mode: TransferMode) -> None:
    """H == T: no block is allocated on C, no byte moves, P is released (REL-1)."""
    pair = make_pair("gemma-3-1b", mode)  # type: ignore[operator]
    assert run_and_check(pair, "hit", 64, 64) is ConsumerState.LOADED
    result = pair.consumer.result("hit")
    assert result is not None
    assert result.num_bytes == 0
    assert result.release is not None
    assert result.release.value == "prefix_hit"
    producer_result = pair.producer.result("hit")
    assert producer_result is not None
    assert producer_result.state is ProducerState.RELEASED


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_window_coverage_failure_before_any_byte(make_pair: object, mode: TransferMode) -> None:
    """A prefix hit that is not whole blocks fails FAILED with a typed reason and moves nothing (WIN-1)."""
    pair = make_pair("gpt-oss-20b", mode)  # type: ignore[operator]
    assert run_and_check(pair, "bad", 100, 8) is ConsumerState.FAILED
    result = pair.consumer.result("bad")
    assert result is not None
    assert result.failure is not None
    assert result.failure.reason is FailureReason.BLOCK_ALIGNMENT
    assert result.num_bytes == 0


def test_out_of_blocks_fails_typed(make_pair: object) -> None:
    pair = make_pair("llama-3.1-8b", TransferMode.READ, num_blocks=12)  # type: ignore[operator]
    with pytest.raises(OutOfBlocksError, match=r"need 40 blocks, 11 free of 11"):
        pair.producer.prefill("huge", num_tokens=16 * 40)
    assert pair.producer.num_free_blocks == 11


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_many_interleaved_requests(make_pair: object, mode: TransferMode) -> None:
    """Step-wise API: start several requests, then poll both endpoints until every one ends."""
    pair = make_pair("gemma-3-27b", mode, num_blocks=600)  # type: ignore[operator]
    producer_free, consumer_free = pair.producer.num_free_blocks, pair.consumer.num_free_blocks
    consumer_before = pair.consumer_pool.snapshot()
    loads = []
    requests = [(f"r{i}", 20 + 37 * i, 16 * (i % 3)) for i in range(6)]
    routed = {}
    for request_id, tokens, _ in requests:
        routed[request_id] = pair.producer.prefill(request_id, num_tokens=tokens).to_kv_transfer_params()
        table = pair.producer.block_table(request_id)
        fill_producer_pages(pair.producer_pool, table, num_tokens=tokens, salt=request_id)
    producer_before = pair.producer_pool.snapshot()
    for request_id, _, hit in requests:
        pair.consumer.begin(TransferParams.from_kv_transfer_params(routed[request_id]), prefix_hit_tokens=hit)
    for _ in range(1000):
        if not pair.consumer.active_requests and not pair.producer.active_requests:
            break
        pair.consumer.poll()
        pair.producer.poll()
    else:
        pytest.fail("requests did not finish")
    for request_id, tokens, _ in requests:
        result = pair.consumer.result(request_id)
        assert result is not None
        assert result.state is ConsumerState.LOADED
        loads.append(
            ExpectedLoad(
                producer_block_ids=result.producer_block_ids,
                consumer_block_ids=result.consumer_block_ids,
                num_tokens=tokens,
                salt=request_id,
            )
        )
    mismatches = check_pools(
        producer=pair.producer_pool,
        consumer=pair.consumer_pool,
        producer_before=producer_before,
        consumer_before=consumer_before,
        loads=loads,
    )
    assert not mismatches, format_mismatches(mismatches)
    for request_id, _, _ in requests:
        pair.consumer.finish(request_id)
    assert (pair.producer.num_free_blocks, pair.consumer.num_free_blocks) == (producer_free, consumer_free)


def test_incompatible_peers_refused_at_handshake() -> None:
    backend = LoopbackBackend()
    gemma, gpt = small_config("gemma-3-1b", 16), small_config("gpt-oss-20b", 16)
    with allocate_pool(gemma, shared=False) as p_pool, allocate_pool(gpt, shared=False) as c_pool:
        producer = ProducerEndpoint(
            engine_id="P", config=gemma, transport=backend.create_agent("p"), regions=p_pool.regions,
            mode=TransferMode.READ,
        )  # fmt: skip
        consumer = ConsumerEndpoint(
            engine_id="C", config=gpt, transport=backend.create_agent("c"), regions=c_pool.regions,
            mode=TransferMode.WRITE,
        )  # fmt: skip
        with pytest.raises(IncompatiblePeerError, match=r"mode: producer='read' consumer='write'") as info:
            connect(producer, consumer)
        assert "mode" in info.value.differences
        backend.close()


def test_unsupported_hybrid_refused_at_handshake() -> None:
    backend = LoopbackBackend()
    config = get_preset("qwen3-next-80b").build_config(num_blocks=4, max_layers_per_group=1, head_size_divisor=64)
    # A state kind the exchange does not know fails closed at the handshake (ADM-1).
    config = attrs.evolve(
        config,
        kv_cache_groups=[
            attrs.evolve(g, kv_cache_spec=attrs.evolve(g.kv_cache_spec, mamba_type="short_conv"))
            if isinstance(g.kv_cache_spec, MambaSpec)
            else g
            for g in config.kv_cache_groups
        ],
    )
    with allocate_pool(config, shared=False) as p_pool, allocate_pool(config, shared=False) as c_pool:
        producer = ProducerEndpoint(
            engine_id="P", config=config, transport=backend.create_agent("p"), regions=p_pool.regions,
            mode=TransferMode.READ,
        )  # fmt: skip
        consumer = ConsumerEndpoint(
            engine_id="C", config=config, transport=backend.create_agent("c"), regions=c_pool.regions,
            mode=TransferMode.READ,
        )  # fmt: skip
        with pytest.raises(UnsupportedHybridError, match=r"unsupported: group \d+ .*'short_conv'"):
            connect(producer, consumer)
        backend.close()


def test_allocator_never_hands_out_the_null_block() -> None:
    allocator = BlockAllocator(5)
    ids = allocator.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4]
    assert allocator.num_free == 0
    with pytest.raises(OutOfBlocksError, match=r"need 1 blocks, 0 free of 4"):
        allocator.allocate(1)
    allocator.free([0, *ids])
    assert allocator.num_free == 4
    with pytest.raises(LocalProtocolError, match="freed twice"):
        allocator.free([1])
    assert list(itertools.islice(iter(allocator.allocate(2)), 2)) == [1, 2]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_peer_block_ids_outside_the_pool_are_refused_before_anything_moves(
    make_pair: object, mode: TransferMode
) -> None:
    """Parameters from a peer never steer a copy outside the registered pool (PLAN-1)."""
    pair = make_pair("gpt-oss-20b", mode)  # type: ignore[operator]
    free = (pair.producer.num_free_blocks, pair.consumer.num_free_blocks)
    consumer_before = pair.consumer_pool.snapshot()
    params = pair.producer.prefill("evil", num_tokens=40)
    far = pair.producer.config.num_blocks + 5
    forged = attrs.evolve(
        params, producer_block_ids=BlockIds([[far + i for i in g] for g in params.producer_block_ids])
    )
    pair.consumer.begin(forged)
    for _ in range(100):
        pair.consumer.poll()
        pair.producer.poll()
    result = pair.consumer.result("evil")
    assert result is not None
    assert result.state is ConsumerState.FAILED
    assert result.failure is not None
    assert result.failure.reason is FailureReason.PROTOCOL
    assert pair.consumer_pool.snapshot() == consumer_before
    assert (pair.producer.num_free_blocks, pair.consumer.num_free_blocks) == free


class _SlowCancel:
    """A loopback agent that does not claim immediate cancel, like NIXL or gloo."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    @property
    def capabilities(self) -> object:
        return attrs.evolve(self._inner.capabilities, immediate_cancel=False)  # type: ignore[attr-defined]


def test_abort_waits_out_the_drain_when_cancel_is_not_immediate(make_pair: object) -> None:
    """A cancelled read counts as drained only after drain_timeout unless the backend stops at once (SM-2)."""
    clock = SteppingClock(step=0.001)
    pair: Pair = make_pair("gemma-3-1b", TransferMode.READ, clock=clock)  # type: ignore[operator]
    pair.consumer.transport = _SlowCancel(pair.consumer.transport)  # type: ignore[assignment]
    free = pair.consumer.num_free_blocks
    params = pair.producer.prefill("a", num_tokens=300)
    pair.consumer.begin(params)
    pair.consumer.poll()
    assert pair.consumer.num_free_blocks < free
    aborted_at = clock.now
    pair.consumer.abort("a")
    while pair.consumer.num_free_blocks < free:
        assert clock.now - aborted_at < 5.0, "blocks never came back"
        pair.consumer.poll()
        pair.producer.poll()
    # Handed back only once the consumer's drain_timeout (0.5 s) had passed since the abort.
    assert clock.now - aborted_at >= 0.5
    result = pair.consumer.result("a")
    assert result is not None
    assert result.state is ConsumerState.ABORTED


def test_a_write_that_ended_is_never_cancelled_by_the_release_that_follows(make_pair: object) -> None:
    """The driver polls transfers before notifications: the release finds the write WRITTEN, not WRITING (SM-1)."""
    pair: Pair = make_pair("gemma-3-1b", TransferMode.WRITE)  # type: ignore[operator]
    for index in range(3):
        result = run_request(pair.producer, pair.consumer, request_id=f"w{index}", num_tokens=40 + index)
        assert result.consumer.state is ConsumerState.LOADED
        assert result.producer.state is ProducerState.RELEASED
    assert pair.producer.driver.cancelled_at is None
    assert pair.consumer.driver.cancelled_at is None
    assert not pair.producer.errors
    assert not pair.consumer.errors


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_the_producer_says_where_its_lists_end_and_a_shifted_list_is_refused(
    make_pair: object, mode: TransferMode
) -> None:
    """Protocol 1.1: P's params carry its lists' ends; a list that claims to end a block later fails ALIGN-1."""
    pair: Pair = make_pair("gemma-3-1b", mode)  # type: ignore[operator]
    params = pair.producer.prefill("r", num_tokens=100)
    groups = pair.producer.config.kv_cache_groups
    assert params.producer_block_ends == tuple(-(-100 // g.kv_cache_spec.block_size) for g in groups)
    # As a producer whose table held one lookahead block more would say it: every end one block later.
    shifted = attrs.evolve(params, producer_block_ends=tuple(end + 1 for end in params.producer_block_ends or ()))
    free = pair.consumer.num_free_blocks
    pair.consumer.begin(shifted)
    result = pair.consumer.result("r")
    assert result is not None
    assert result.state is ConsumerState.FAILED
    assert result.failure is not None
    assert result.failure.reason is FailureReason.BLOCK_ALIGNMENT
    assert "past the request's last block" in result.failure.detail
    assert result.num_bytes == 0
    assert pair.consumer.num_free_blocks == free
