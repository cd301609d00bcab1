"""Cases on the handshake and the wire: the mismatch table (HS-1), parallel layouts (PAR-9), versions (VER-1)."""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from kvspec import (
    DTYPE_SIZES,
    PROTOCOL_VERSION,
    CacheDeclaration,
    Completion,
    EngineDescriptor,
    GroupDescriptor,
    IncompatiblePeerError,
    KVCacheConfig,
    KVSpecError,
    Release,
    ReleaseOutcome,
    SpecKind,
    StateProfile,
    TransferMode,
    UnsupportedVersionError,
    decode,
    encode,
    format_error,
    is_hma_required,
)
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, ParallelLayout, RankLayout, SubBlock

from .._cases import case
from .._context import CaseContext
from .._scenario import Request, Scenario
from ..configs import full, make_config, mla, sw

__all__: list[str] = []

BASE = make_config(full(4), sw(8, 4), num_blocks=32)


def _renamed(config: KVCacheConfig) -> KVCacheConfig:

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
        if not isinstance(result.refused, IncompatiblePeerError):
            got = "a transfer" if result.refused is None else format_error(result.refused)
            problems.append(f"{name}: expected IncompatiblePeerError at handshake, got {got}")
        elif field not in str(result.refused):
            problems.append(f"{name}: the error does not name {field!r}: {format_error(result.refused)}")
        if result.outcomes or result.mismatches:
            problems.append(f"{name}: requests ran or memory changed after a refused handshake")
    if problems:
        raise ctx.fail("HS-1: " + "\n".join(problems))


# --------------------------------------------------------------------------- one field at a time


def _base_descriptor() -> EngineDescriptor:
    return EngineDescriptor.from_config(
        engine_id="producer",
        config=BASE,
        mode=TransferMode.READ,
        hma_enabled=is_hma_required(BASE),
        transport_metadata=b"producer-agent",
    )


def equal_width_dtype_pairs() -> list[tuple[str, str]]:
    """Every pair of distinct dtypes :class:`kvspec.DType` knows whose items have the same width (HS-1)."""
    return [(a, b) for a, b in itertools.combinations(sorted(DTYPE_SIZES), 2) if DTYPE_SIZES[a] == DTYPE_SIZES[b]]


def _declared_caches(base: EngineDescriptor) -> tuple[CacheDeclaration, ...]:
    # One declaration per group, each exchanged (CACHE-1).
    return tuple(
        CacheDeclaration(name=f"group.{g}", kind=group.kind.value, layer_names=group.layer_names)
        for g, group in enumerate(base.groups)
    )


def _group_row(index: int, **changes: object) -> EngineDescriptor:
    base = _base_descriptor()
    groups = list(base.groups)
    groups[index] = attrs.evolve(groups[index], **changes)  # type: ignore[arg-type]
    return attrs.evolve(base, groups=tuple(groups))


Row = tuple[str, EngineDescriptor, EngineDescriptor, str | None]


def field_alone_rows() -> list[Row]:
    """(row, producer, consumer differing in one field only, the field reported or None where HS-1 allows it).

    Rows that only change a field the peers may disagree on (minor version,
    engine id, block count, transport metadata) expect the pair accepted.
    Group fields change in group 1 (the sliding-window group) unless the field
    only exists on another kind.
    """
    base = _base_descriptor()
    major, minor = base.protocol_version
    sw_group = base.groups[1]
    rows: list[Any] = [
        ("protocol major", attrs.evolve(base, protocol_version=(major + 1, 0)), "protocol_version.major"),
        ("protocol minor", attrs.evolve(base, protocol_version=(major, minor + 1)), None),
        ("engine id", attrs.evolve(base, engine_id="consumer"), None),
        ("mode", attrs.evolve(base, mode=TransferMode.WRITE), "mode"),
        ("HMA flag", attrs.evolve(base, hma_enabled=not base.hma_enabled), "hma_enabled"),
        ("group count", attrs.evolve(base, groups=base.groups[:1]), "num_groups"),
        ("group order", attrs.evolve(base, groups=base.groups[::-1]), "groups.order"),
        ("block count", attrs.evolve(base, num_blocks=base.num_blocks * 2), None),
        ("TP size", attrs.evolve(base, tp_size=2), "tp_size"),
        ("transport metadata", attrs.evolve(base, transport_metadata=b"consumer-agent"), None),
        # Chosen, not compared: two offers with one algorithm in common agree on it (INT-2).
        ("digest algorithms", attrs.evolve(base, digest_algorithms=("blake2b-128",)), None),
        ("kind", _group_row(1, kind=SpecKind.SLIDING_WINDOW_MLA), "groups[1].kind"),
        ("block size", _group_row(1, block_size=sw_group.block_size * 2), "groups[1].block_size"),
        (
            "sliding window",
            _group_row(1, sliding_window=(sw_group.sliding_window or 0) + 4),
            "groups[1].sliding_window",
        ),
        ("chunk size", _group_row(0, attention_chunk_size=8), "groups[0].attention_chunk_size"),
        ("KV heads", _group_row(1, num_kv_heads=(sw_group.num_kv_heads or 1) * 2), "groups[1].num_kv_heads"),
        ("head size", _group_row(1, head_size=(sw_group.head_size or 1) * 2), "groups[1].head_size"),
        ("page size", _group_row(1, page_size_bytes=sw_group.page_size_bytes * 2), "groups[1].page_size_bytes"),
        (
            "layer names",
            _group_row(1, layer_names=(*sw_group.layer_names[:-1], "other." + sw_group.layer_names[-1])),
            "groups[1].layer_names",
        ),
        # Protocol 1.2: a state group's layout (STATE-5) and the engines' state profile (STATE-1).
        ("state shapes", _group_row(1, state_shapes=((2, 4),)), "groups[1].state_shapes"),
        ("state dtypes", _group_row(1, state_dtypes=("bfloat16",)), "groups[1].state_dtypes"),
        ("state kind", _group_row(1, mamba_type="gdn_attn"), "groups[1].mamba_type"),
        ("conv layout", _group_row(1, conv_layout="SD"), "groups[1].conv_layout"),
        ("state profile", attrs.evolve(base, state_profile=StateProfile.PREBUILT), "state_profile"),
        # Protocol 1.3: a layout on one side only is today's layout on both: equal TP, accepted (PAR-9).
        ("parallel layout", attrs.evolve(base, parallel=_layout(base, tp=1, rank=0)), None),
        # Protocol 1.3: declared caches (CACHE-1). A peer that declares none means its groups: nothing to compare.
        ("declared caches", attrs.evolve(base, caches=_declared_caches(base)), None),
    ]
    rows = [(name, base, consumer, field) for name, consumer, field in rows]
    for a, b in equal_width_dtype_pairs():
        rows.append((f"dtype {a} vs {b}", _group_row(1, dtype=a), _group_row(1, dtype=b), "groups[1].dtype"))
    return rows


# Rows that move whole groups: every per-group field differs with them, and HS-1 lists them all.
_WHOLE_GROUPS = ("num_groups", "groups.order")


def _covered_fields() -> set[str]:
    return {f.name for f in attrs.fields(EngineDescriptor)} | {
        f"groups.{f.name}" for f in attrs.fields(GroupDescriptor)
    }


def _row_fields(rows: list[Row]) -> set[str]:
    found: set[str] = set()
    for _, base, consumer, _ in rows:
        for field in attrs.fields(EngineDescriptor):
            if getattr(consumer, field.name) != getattr(base, field.name):
                found.add(field.name)
        for p, c in zip(base.groups, consumer.groups, strict=False):
            found |= {
                f"groups.{f.name}" for f in attrs.fields(GroupDescriptor) if getattr(p, f.name) != getattr(c, f.name)
            }
    return found


@case("HS-1", "every-field-alone")
def _hs_field_alone(ctx: CaseContext) -> None:
    """Each descriptor field differing alone is refused naming that field only, or accepted where HS-1 allows it.

    Every field of EngineDescriptor and GroupDescriptor has a row, and the
    dtype rows pair every two dtypes of equal width (same page size), so a
    check that compares only widths or page sizes is caught.
    """
    rows = field_alone_rows()
    missing = _covered_fields() - _row_fields(rows)
    if missing:
        raise ctx.fail(f"HS-1: the table has no row for {sorted(missing)}")
    problems = []
    for name, producer, consumer, field in rows:
        try:
            ctx.connector.check_peer(producer, consumer)
        except (IncompatiblePeerError, UnsupportedVersionError) as exc:
            if field is None:
                problems.append(f"{name}: HS-1 lets this field differ, but the pair was refused: {exc}")
            elif isinstance(exc, IncompatiblePeerError) and field not in exc.differences:
                problems.append(f"{name}: expected {field!r} in differences, got {sorted(exc.differences)}")
            elif isinstance(exc, IncompatiblePeerError) and field not in _WHOLE_GROUPS and len(exc.differences) != 1:
                # One field differs, so one is reported: a second one means the check compares something else.
                problems.append(f"{name}: expected only {field!r} in differences, got {sorted(exc.differences)}")
            elif field not in str(exc):
                problems.append(f"{name}: the error does not name {field!r}: {exc}")
        except KVSpecError as exc:
            problems.append(f"{name}: expected IncompatiblePeerError, got {type(exc).__name__}: {exc}")
        else:
            if field is not None:
                problems.append(f"{name}: accepted, but {field} differs (HS-1)")
    if problems:
        raise ctx.fail("HS-1: " + "\n".join(problems))


@case("HS-1", "dtype-and-heads-mismatch")
def _hs_dtype(ctx: CaseContext) -> None:
    """A different KV dtype or head count is refused at handshake with both values."""

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
        if result.refused is None or field not in str(result.refused):
            got = None if result.refused is None else format_error(result.refused)
            raise ctx.fail(f"HS-1: a {field} mismatch must be refused at handshake naming it, got {got}")


@case("HS-1", "compatible-pair-accepted")
def _hs_ok(ctx: CaseContext) -> None:
    """Equal descriptors pass the handshake even when the tensors are laid out differently."""
    consumer = make_config(full(4), sw(8, 4), num_blocks=48, layout="per_layer")
    result = ctx.run(Scenario(config=BASE, consumer_config=consumer, requests=[Request(request_id="r", num_tokens=9)]))
    ctx.expect(result, loaded=["r"], rule="HS-1")


# --------------------------------------------------------------------------- PAR-9 parallel layouts at handshake


def _kv_page(heads: int, order: PageOrder = PageOrder.HND) -> CanonicalPage:
    kv = [SubBlock(name="kv_heads", extent=heads)]
    return CanonicalPage(
        tensors=[PageTensor(name=n, sub_blocks=kv, rows=4, element_bytes=2, order=order, token_rows=True) for n in "kv"]
    )


def _layout(
    descriptor: EngineDescriptor, *, tp: int, rank: int, heads: int = 4, order: PageOrder = PageOrder.HND, **kw: Any
) -> ParallelLayout:
    pages = [_kv_page(heads, order)] * len(descriptor.groups)
    return ParallelLayout(rank=RankLayout(tp_size=tp, tp_rank=rank, **kw), pages=pages)


def _rank(tp: int, rank: int, **kw: Any) -> EngineDescriptor:
    """One rank of an engine of BASE's model with 4 KV heads in all, at TP ``tp``: its groups hold its share."""
    base = _base_descriptor()
    heads = 4 // min(tp, 4)
    groups = tuple(attrs.evolve(g, num_kv_heads=heads, page_size_bytes=g.page_size_bytes * heads) for g in base.groups)
    ranked = attrs.evolve(base, groups=groups, tp_size=tp, engine_id=f"tp{tp}.{rank}")
    return attrs.evolve(ranked, parallel=_layout(ranked, tp=tp, rank=rank, **kw))


@case("PAR-9", "tp1-to-tp4-admitted")
def _par9_admitted(ctx: CaseContext) -> None:
    """Both peers send their layout (1.3): a TP1 producer pairs with every TP4 consumer rank, and each TP4 rank
    with a TP1 consumer, HND and NHD pages alike; "tp_size must be equal" no longer refuses them."""
    problems = []
    for order in (PageOrder.HND, PageOrder.NHD):
        pairs = [(_rank(1, 0, order=order), _rank(4, r, order=order)) for r in range(4)]
        pairs += [(_rank(4, r, order=order), _rank(1, 0, order=order)) for r in range(4)]
        for producer, consumer in pairs:
            try:
                ctx.connector.check_peer(producer, consumer)
            except KVSpecError as exc:
                problems.append(f"{producer.engine_id} to {consumer.engine_id} ({order.value}): refused: {exc}")
    if problems:
        raise ctx.fail("PAR-9: layouts that compose must be admitted:\n" + "\n".join(problems))


# (row, producer, consumer, the field and rule the refusal must name)
_LAYOUT_REFUSALS: list[tuple[str, EngineDescriptor, EngineDescriptor, str]] = [
    ("3 KV heads over TP4", _rank(1, 0, heads=3), _rank(4, 1, heads=3), "sub_blocks[0].extent (PAR-1)"),
    ("TP2 to TP3", _rank(2, 0), _rank(3, 1), "rank.tp_size (PAR-4)"),
    ("an opaque page", _rank(1, 0, order=PageOrder.OPAQUE), _rank(4, 2, order=PageOrder.OPAQUE), "order (PAR-5)"),
    ("another KV head count", _rank(1, 0), _rank(4, 3, heads=8), "sub_blocks[0].extent (PAR-9)"),
    ("HND meets NHD", _rank(1, 0), _rank(4, 0, order=PageOrder.NHD), "tensors[0].order (PAR-9)"),
    ("a rank not faced", _rank(4, 3), _rank(2, 0), "rank.tp_rank (PAR-4)"),
]


@case("PAR-9", "layouts-that-do-not-compose-refused")
def _par9_refused(ctx: CaseContext) -> None:
    """Layouts whose byte maps do not compose are refused at handshake naming the field and the PAR rule:
    a KV head count that does not divide, TP sizes that do not, an opaque page to slice, pages that differ."""
    problems = []
    for name, producer, consumer, field in _LAYOUT_REFUSALS:
        try:
            ctx.connector.check_peer(producer, consumer)
        except IncompatiblePeerError as exc:
            if not any(key.startswith("parallel.") and key.endswith(field) for key in exc.differences):
                problems.append(f"{name}: expected a difference ending {field!r}, got {sorted(exc.differences)}")
        except KVSpecError as exc:
            problems.append(f"{name}: expected IncompatiblePeerError, got {type(exc).__name__}: {exc}")
        else:
            problems.append(f"{name}: admitted, but the byte maps do not compose ({field})")
    if problems:
        raise ctx.fail("PAR-9: " + "\n".join(problems))


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
    if not isinstance(result.refused, UnsupportedVersionError):
        got = None if result.refused is None else format_error(result.refused)
        raise ctx.fail(f"VER-1: expected UnsupportedVersionError for major {major}, got {got}")


@case("VER-1", "newer-minor-accepted")
def _ver_minor(ctx: CaseContext) -> None:
    """A peer with a newer minor version interoperates."""
    scenario = Scenario(
        config=BASE,
        handshake_overrides=(("protocol_version", (PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 1)),),
        requests=[Request(request_id="r", num_tokens=9)],
    )
    ctx.expect(ctx.run(scenario), loaded=["r"], rule="VER-1")


@case("VER-1", "notification-bytes-intact", requires=["local_pools", "notifications"])
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
