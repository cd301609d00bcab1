"""Cases on the handshake and the wire: the mismatch table (HS-1) and versioned messages (VER-1)."""

from __future__ import annotations

from kvspec import PROTOCOL_VERSION, Completion, KVCacheConfig, KVSpecError, Release, ReleaseOutcome, decode, encode

from .._cases import case
from .._context import CaseContext
from .._scenario import Request, Scenario
from ..configs import full, make_config, mla, sw

__all__: list[str] = []

BASE = make_config(full(4), sw(8, 4), num_blocks=32)


def _renamed(config: KVCacheConfig) -> KVCacheConfig:
    import attrs

    group = config.kv_cache_groups[1]
    tensor = config.kv_cache_tensors[1]
    names = tuple(f"other.{n}" for n in group.layer_names)
    return attrs.evolve(
        config,
        kv_cache_groups=(config.kv_cache_groups[0], attrs.evolve(group, layer_names=names)),
        kv_cache_tensors=(config.kv_cache_tensors[0], attrs.evolve(tensor, layers=names)),
    )


# (row name, consumer config, consumer descriptor overrides, a field the error must name)
MISMATCHES: list[tuple[str, KVCacheConfig, tuple[tuple[str, object], ...], str]] = [
    ("block size", make_config(full(8), sw(8, 8), num_blocks=32), (), "block_size"),
    ("window", make_config(full(4), sw(16, 4), num_blocks=32), (), "sliding_window"),
    ("group kind", make_config(mla(4), sw(8, 4), num_blocks=32), (), "kind"),
    ("group count", make_config(full(4), sw(8, 4), sw(16, 4), num_blocks=32), (), "num_groups"),
    ("group order", make_config(sw(8, 4), full(4), num_blocks=32), (), "groups"),
    ("layer count", make_config(full(4), sw(8, 4), num_blocks=32, layers=[2, 3]), (), "layer_names"),
    ("layer names", _renamed(BASE), (), "layer_names"),
    ("mode", BASE, (("mode", "write"),), "mode"),
    ("HMA flag", BASE, (("hma_enabled", False),), "hma_enabled"),
    ("TP size", BASE, (("tp_size", 2),), "tp_size"),
]


@case("HS-1", "mismatch-table")
def _hs_table(ctx: CaseContext) -> None:
    """Every mismatch of the table is refused at handshake, naming the field, before any byte moves.

    Rows: block size, window, group kind, group count and order, layer count and
    names, mode, HMA flag, TP size.
    """
    problems = []
    for name, consumer, overrides, field in MISMATCHES:
        scenario = Scenario(
            config=BASE,
            consumer_config=consumer,
            handshake_overrides=overrides,
            requests=[Request(request_id="r", num_tokens=9)],
        )
        result = ctx.run(scenario)
        if result.refused is None or not result.refused.startswith("IncompatiblePeerError"):
            problems.append(
                f"{name}: expected IncompatiblePeerError at handshake, got {result.refused or 'a transfer'}"
            )
        elif field not in result.refused:
            problems.append(f"{name}: the error does not name {field!r}: {result.refused}")
        if result.outcomes or result.mismatches:
            problems.append(f"{name}: requests ran or memory changed after a refused handshake")
    if problems:
        raise ctx.fail("HS-1: " + "\n".join(problems))


@case("HS-1", "dtype-and-heads-mismatch")
def _hs_dtype(ctx: CaseContext) -> None:
    """A different KV dtype or head count is refused at handshake with both values."""
    import attrs

    for field, value in (("dtype", "float16"), ("num_kv_heads", 2), ("head_size", 4)):
        group = BASE.kv_cache_groups[0]
        spec = attrs.evolve(group.kv_cache_spec, **{field: value})  # type: ignore[arg-type]
        page = spec.page_size_bytes
        n = len(group.layer_names)
        from kvspec import KVCacheTensor

        tensor = KVCacheTensor(size=32 * n * page, layers=group.layer_names, layer_stride=page, block_stride=n * page)
        consumer = attrs.evolve(
            BASE,
            kv_cache_groups=(attrs.evolve(group, kv_cache_spec=spec), BASE.kv_cache_groups[1]),
            kv_cache_tensors=(tensor, BASE.kv_cache_tensors[1]),
        )
        result = ctx.run(
            Scenario(config=BASE, consumer_config=consumer, requests=[Request(request_id="r", num_tokens=9)])
        )
        if result.refused is None or field not in result.refused:
            raise ctx.fail(f"HS-1: a {field} mismatch must be refused at handshake naming it, got {result.refused}")


@case("HS-1", "compatible-pair-accepted")
def _hs_ok(ctx: CaseContext) -> None:
    """Equal descriptors pass the handshake even when the tensors are laid out differently."""
    consumer = make_config(full(4), sw(8, 4), num_blocks=48, layout="per_layer")
    result = ctx.run(Scenario(config=BASE, consumer_config=consumer, requests=[Request(request_id="r", num_tokens=9)]))
    ctx.expect(result, loaded=["r"], rule="HS-1")


@case("VER-1", "other-major-refused")
def _ver_major(ctx: CaseContext) -> None:
    """A peer speaking another major protocol version is refused at handshake with UnsupportedVersionError."""
    major = PROTOCOL_VERSION[0] + 1
    scenario = Scenario(
        config=BASE,
        handshake_overrides=(("protocol_version", (major, 0)),),
        requests=[Request(request_id="r", num_tokens=9)],
    )
    result = ctx.run(scenario)
    if result.refused is None or not result.refused.startswith("UnsupportedVersionError"):
        raise ctx.fail(f"VER-1: expected UnsupportedVersionError for major {major}, got {result.refused}")


@case("VER-1", "newer-minor-accepted")
def _ver_minor(ctx: CaseContext) -> None:
    """A peer with a newer minor version interoperates."""
    scenario = Scenario(
        config=BASE,
        handshake_overrides=(("protocol_version", (PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 1)),),
        requests=[Request(request_id="r", num_tokens=9)],
    )
    ctx.expect(ctx.run(scenario), loaded=["r"], rule="VER-1")


@case("VER-1", "notification-bytes-intact", requires=["notifications"])
def _ver_bytes(ctx: CaseContext) -> None:
    """Notifications carry any bytes intact and in order: every message type, unknown fields, all 256 byte values."""
    import json

    from kvspec.testing import allocate_pool
    from kvspec.transport import TransferState

    release = encode(Release(request_id="r1", consumer_engine_id="c", outcome=ReleaseOutcome.LOADED))
    newer = json.loads(release)
    newer["a_field_from_a_newer_minor"] = {"x": [1, 2]}
    newer["v"] = [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 1]
    messages = [
        release,
        encode(Completion(request_id="r2", producer_engine_id="p")),
        json.dumps(newer, sort_keys=True).encode(),
        bytes(range(256)),
        b"\x00" * 3 + b"\xff" * 3,
        bytes(range(256)) * 16,
    ]
    config = make_config(full(4), num_blocks=4)
    with allocate_pool(config) as p_pool, allocate_pool(config) as c_pool:
        producer, consumer = ctx.backend.create_agent("producer"), ctx.backend.create_agent("consumer")
        try:
            producer.register_memory(p_pool.regions)
            consumer.register_memory(c_pool.regions)
            p_name = consumer.add_remote_agent(producer.get_agent_metadata())
            producer.add_remote_agent(consumer.get_agent_metadata())
            for message in messages:
                consumer.send_notification(p_name, message)
            got: list[bytes] = []
            import time

            deadline = time.monotonic() + 5.0 * ctx.time_scale
            while len(got) < len(messages) and time.monotonic() < deadline:
                got += [n.message for n in producer.get_notifications()]
                consumer.get_notifications()
                time.sleep(0.0005)
            if got != messages:
                raise ctx.fail(
                    f"VER-1: sent {len(messages)} notifications, received {len(got)}, equal={got == messages}"
                )
            decoded = decode(got[2])
            if not isinstance(decoded, Release) or decoded.request_id != "r1":
                raise ctx.fail(f"VER-1: a newer minor's message must decode, ignoring unknown fields, got {decoded!r}")
            for junk in (got[3], got[4], got[5][:17]):
                try:
                    decode(junk)
                except KVSpecError:
                    continue
                except Exception as exc:
                    raise ctx.fail(
                        f"VER-1: decoding arbitrary bytes raised {type(exc).__name__}, not a kvspec error"
                    ) from exc
            del TransferState
        finally:
            consumer.close()
            producer.close()
