"""A digest defined over the canonical page, so that any producer and consumer layout can compare, INT-2.

The canonical page (PAR-2) is the parallelism-free content of one block of one
layer; every rank's physical page is a projection of it. INT-2 cuts the
canonical page into **cells** that every rank of both engines holds whole
(:func:`get_digest_cells`), digests each cell with its place bound in
(:func:`digest_cell`), and adds the cell digests modulo 2**128. A sum does not
depend on who added what: each rank of the producer digests the cells it
counts (:func:`get_counting_rank`), each rank of the consumer does the same
with what it received, and the sums over all ranks and PP stages agree
exactly when every cell agrees, whatever the TP, PP and page sizes
(:func:`digest_rank_page`, :func:`combine_digests`, :func:`check_digests`).

A cell is ``units`` consecutive units of one sub-block of one tensor, over
``rows`` rows (a chunk of ``granule`` tokens for a tensor whose rows are
tokens, all rows otherwise). Its bytes are read unit-major, row-minor (the
``hnd`` order), whatever order the page uses, so an ``nhd`` rank and an
``hnd`` rank agree too. Two engine sizes fix the cells: ``split``, the least
common multiple of the two TP sizes (each split sub-block is cut into
``min(extent, split)`` cells), and ``granule``, the greatest common divisor of
the two block sizes in tokens (:func:`get_digest_shape`).

Modes (:class:`DigestMode`), each with its false-negative model:

- ``full``: every byte of every cell is digested. A request passes with a
  corrupted byte only if two different inputs collide: about ``2**-128`` per
  differing cell for XXH3-128 or BLAKE2b-128 on accidental faults. The digest
  is not keyed and not a MAC: a peer that lies is the transport's to stop.
- ``sampled``: a request is digested (in full) exactly when
  :func:`is_request_sampled` says so, deterministically from the seed and the
  request id, so both sides agree without a message. A fault in an unsampled
  request is never seen: a fault hitting ``k`` requests independently is missed
  with probability ``(1 - rate)**k``; a fault tied to particular request ids is
  missed for ever if none of them is sampled (change the seed).
- ``partial``: each cell contributes its first and last bytes, ``ceil(n / C)``
  in all for a page of ``C`` cells and ``n = partial_bytes`` (:func:`get_partial_ranges`);
  the cell's size, index and position are in its header, so pages of different
  size, index or position never collide by construction (a head/tail CRC
  without them confuses ``abcdefgh`` with ``abcdXefgh``). A fault that changes
  no sampled byte is missed: a single flipped byte at a uniform place is
  missed with probability ``1 - sampled / page bytes``; a wrong, stale or
  misplaced page is missed only if its sampled bytes equal the expected ones.

Algorithms (:class:`DigestAlgorithm`): XXH3-128 (``xxhash``, a dependency of
kvspec) is the default, BLAKE2b-128 (:mod:`hashlib`) is negotiable; the
handshake picks the first of :data:`DIGEST_ALGORITHMS` both sides offer
(:func:`choose_digest_algorithm`). Measured against a copy of the same bytes:
``benchmarks/bench_integrity.py`` and docs/spec/integrity.md.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; a bare install still speaks BLAKE2b-128
    xxhash = None  # type: ignore[assignment]

from kvspec.core._errors import ConfigError, IntegrityMismatchError, MalformedMessageError, ParallelismError
from kvspec.spec.parallel import CanonicalPage, PageOrder, SubBlock, get_owned_units

__all__ = [
    "DIGEST_ALGORITHMS",
    "DIGEST_MODULUS",
    "MAX_PARTIAL_BYTES",
    "SAMPLE_SCALE",
    "DigestAlgorithm",
    "DigestCell",
    "DigestMode",
    "DigestPolicy",
    "PlannedCell",
    "check_digests",
    "choose_digest_algorithm",
    "combine_digests",
    "digest_cell",
    "digest_planned_page",
    "digest_rank_page",
    "format_digest",
    "get_counting_rank",
    "get_digest_cells",
    "get_digest_plan",
    "get_digest_shape",
    "get_layer_prefix",
    "get_offered_algorithms",
    "get_partial_ranges",
    "is_request_sampled",
    "parse_digest",
]

Buffer: TypeAlias = memoryview | bytes | bytearray
"""The bytes a rank digests a page from: any flat buffer (INT-2)."""

DIGEST_MODULUS = 1 << 128
"""Cell digests are 128-bit integers (little-endian digest bytes) added modulo this (INT-2)."""

SAMPLE_SCALE = 1_000_000
"""``sample_ppm`` counts requests per this many (INT-2)."""

MAX_PARTIAL_BYTES = 1 << 20
"""The largest ``partial_bytes`` a peer may ask for (a codec bound, INT-2)."""

_PERSON = b"kvspec-INT-2"


class DigestAlgorithm(str, enum.Enum):
    """The hash of one cell (INT-2): XXH3-128 (``xxhash``, default) or BLAKE2b-128 (:mod:`hashlib`)."""

    XXH3_128 = "xxh3-128"
    BLAKE2B_128 = "blake2b-128"


DIGEST_ALGORITHMS: tuple[DigestAlgorithm, ...] = (DigestAlgorithm.XXH3_128, DigestAlgorithm.BLAKE2B_128)
"""Every algorithm kvspec speaks, in preference order: the handshake picks the first both offer (INT-2)."""


class DigestMode(str, enum.Enum):
    """Which requests and bytes are digested (INT-2): every byte, a seeded sample of requests, n bytes a page."""

    FULL = "full"
    SAMPLED = "sampled"
    PARTIAL = "partial"


def _int_in(low: int, high: int) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"DigestPolicy.{attribute.name}: expected an int in [{low}, {high}], got {value!r}")

    return check


def _to_algorithm(value: object) -> DigestAlgorithm:
    try:
        return DigestAlgorithm(value)
    except ValueError:
        raise ConfigError(
            f"DigestPolicy.algorithm: expected one of {[a.value for a in DigestAlgorithm]}, got {value!r} (INT-2)"
        ) from None


def _to_mode(value: object) -> DigestMode:
    try:
        return DigestMode(value)
    except ValueError:
        raise ConfigError(
            f"DigestPolicy.mode: expected one of {[m.value for m in DigestMode]}, got {value!r} (INT-2)"
        ) from None


@attrs.frozen(kw_only=True)
class DigestPolicy:
    """What both sides digest (INT-2): the algorithm, the mode and its parameters.

    ``sample_ppm`` (sampled): requests per million digested; ``seed`` (sampled):
    which ones; ``partial_bytes`` (partial): bytes digested per canonical page.
    """

    algorithm: DigestAlgorithm = attrs.field(default=DigestAlgorithm.XXH3_128, converter=_to_algorithm)
    mode: DigestMode = attrs.field(default=DigestMode.FULL, converter=_to_mode)
    sample_ppm: int = attrs.field(default=SAMPLE_SCALE, validator=_int_in(0, SAMPLE_SCALE))
    seed: int = attrs.field(default=0, validator=_int_in(0, (1 << 64) - 1))
    partial_bytes: int = attrs.field(default=64, validator=_int_in(1, MAX_PARTIAL_BYTES))


def get_offered_algorithms() -> tuple[DigestAlgorithm, ...]:
    """The algorithms this install can compute, in preference order: what a handshake offers (INT-2)."""
    return tuple(a for a in DIGEST_ALGORITHMS if a is not DigestAlgorithm.XXH3_128 or xxhash is not None)


def choose_digest_algorithm(ours: Iterable[str], theirs: Iterable[str]) -> DigestAlgorithm | None:
    """The first of :data:`DIGEST_ALGORITHMS` both sides offer, or ``None`` (no common algorithm) (INT-2).

    The order is kvspec's, not either side's, so both compute the same choice.
    """
    both = set(ours) & set(theirs)
    return next((a for a in DIGEST_ALGORITHMS if a.value in both), None)


def is_request_sampled(policy: DigestPolicy, request_id: str) -> bool:
    """Whether a request is digested: always in ``full`` and ``partial``; in ``sampled``, a seeded draw (INT-2).

    The draw is the first 8 bytes (little-endian) of BLAKE2b keyed with the
    seed (8 bytes, little-endian) over the request id in UTF-8, modulo
    :data:`SAMPLE_SCALE`, below ``sample_ppm``. Both sides compute it from the
    same two values, so they agree on every request without a message.
    """
    if policy.mode is not DigestMode.SAMPLED:
        return True
    draw = hashlib.blake2b(
        request_id.encode("utf-8"), digest_size=8, key=policy.seed.to_bytes(8, "little"), person=_PERSON
    ).digest()
    return int.from_bytes(draw, "little") % SAMPLE_SCALE < policy.sample_ppm


# --------------------------------------------------------------------------- cells


def get_digest_shape(
    *, producer_tp: int, consumer_tp: int, producer_block_size: int, consumer_block_size: int
) -> tuple[int, int]:
    """``(split, granule)``: the lcm of the TP sizes and the gcd of the block sizes (INT-2)."""
    for name, value in (
        ("producer_tp", producer_tp),
        ("consumer_tp", consumer_tp),
        ("producer_block_size", producer_block_size),
        ("consumer_block_size", consumer_block_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}: expected a positive int, got {value!r} (INT-2)")
    return math.lcm(producer_tp, consumer_tp), math.gcd(producer_block_size, consumer_block_size)


@attrs.frozen(kw_only=True)
class DigestCell:
    """Units ``[first_unit, first_unit + units)`` of sub-block ``sub_block`` of tensor ``tensor``, rows ``[first_row, first_row + rows)``."""  # noqa: E501

    tensor: int
    sub_block: int
    first_unit: int
    units: int
    first_row: int
    rows: int
    nbytes: int


def get_digest_cells(page: CanonicalPage, *, split: int, granule: int) -> tuple[DigestCell, ...]:
    """The cells of a canonical page, in order: tensor, sub-block, unit run, row chunk (INT-2).

    A replicated sub-block is one run of all its units; a split one is cut into
    ``min(extent, split)`` equal runs, which every rank of either engine holds
    whole (PAR-1). A tensor whose rows are tokens is cut into chunks of
    ``granule`` rows (its rows must be a multiple); any other tensor is one chunk.
    """
    if split <= 0 or granule <= 0:
        raise ConfigError(f"split, granule: expected positive ints, got {split!r}, {granule!r} (INT-2)")
    cells: list[DigestCell] = []
    for t, tensor in enumerate(page.tensors):
        chunk = granule if tensor.token_rows else tensor.rows
        if tensor.rows % chunk:
            raise ParallelismError(
                f"granule: expected a divisor of tensor {tensor.name}'s {tensor.rows} token rows, got {granule} (INT-2)"
            )
        for s, block in enumerate(tensor.sub_blocks):
            runs = 1 if block.replicated else min(block.extent, split)
            if block.extent % runs:
                raise ParallelismError(
                    f"{block.name}.extent: expected a multiple of {runs} (split {split}), got {block.extent} (INT-2)"
                )
            units = block.extent // runs
            for run in range(runs):
                for first_row in range(0, tensor.rows, chunk):
                    cells.append(
                        DigestCell(
                            tensor=t,
                            sub_block=s,
                            first_unit=run * units,
                            units=units,
                            first_row=first_row,
                            rows=chunk,
                            nbytes=units * chunk * block.width * tensor.element_bytes,
                        )
                    )
    return tuple(cells)


def get_counting_rank(block: SubBlock, first_unit: int, *, tp_size: int) -> int:
    """The rank that adds a cell starting at unit ``first_unit``: the lowest rank that holds it (INT-2).

    A replicated or GQA-replicated unit is held by several ranks; exactly one
    adds it, or a sum over ranks would count it twice.
    """
    if block.replicated:
        return 0
    for rank in range(tp_size):
        start, end = get_owned_units(block, tp_size=tp_size, tp_rank=rank)
        if start <= first_unit < end:
            return rank
    raise ParallelismError(f"{block.name}: unit {first_unit} is held by no rank of {tp_size} (INT-2)")


@attrs.frozen(kw_only=True)
class PlannedCell:
    """A cell one rank adds: its static header and its ``(offset, nbytes)`` pieces in the rank's page, in cell order."""

    cell: DigestCell
    header: bytes
    pieces: tuple[tuple[int, int], ...]
    row_offset: int | None
    """``cell.first_row`` for a token tensor (its position is the page's plus this), ``None`` otherwise."""


def _cell_pieces(page: CanonicalPage, cell: DigestCell, tp_size: int, tp_rank: int) -> tuple[tuple[int, int], ...]:
    """Where a cell's bytes lie in rank ``tp_rank``'s page, unit-major then row-minor (PAR-2, INT-2)."""
    base = 0
    for tensor in page.tensors[: cell.tensor]:
        owned = [get_owned_units(b, tp_size=tp_size, tp_rank=tp_rank) for b in tensor.sub_blocks]
        base += (
            tensor.rows
            * tensor.element_bytes
            * sum((e - s) * b.width for b, (s, e) in zip(tensor.sub_blocks, owned, strict=True))
        )
    tensor = page.tensors[cell.tensor]
    owned = [get_owned_units(b, tp_size=tp_size, tp_rank=tp_rank) for b in tensor.sub_blocks]
    unit_bytes = [b.width * tensor.element_bytes for b in tensor.sub_blocks]
    local = [(e - s) * u for (s, e), u in zip(owned, unit_bytes, strict=True)]  # a row's bytes of each sub-block
    ub = unit_bytes[cell.sub_block]
    first = cell.first_unit - owned[cell.sub_block][0]
    pieces: list[tuple[int, int]] = []
    for unit in range(first, first + cell.units):
        for row in range(cell.first_row, cell.first_row + cell.rows):
            if tensor.order is PageOrder.NHD:
                offset = base + row * sum(local) + sum(local[: cell.sub_block]) + unit * ub
            else:  # hnd and opaque: a sub-block's units lie one after another, each over all rows
                offset = base + tensor.rows * sum(local[: cell.sub_block]) + (unit * tensor.rows + row) * ub
            if pieces and pieces[-1][0] + pieces[-1][1] == offset:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + ub)
            else:
                pieces.append((offset, ub))
    return tuple(pieces)


@functools.lru_cache(maxsize=256)
def get_digest_plan(
    page: CanonicalPage, *, tp_size: int, tp_rank: int, split: int, granule: int, partial_bytes: int | None = None
) -> tuple[PlannedCell, ...]:
    """The cells rank ``tp_rank`` of ``tp_size`` adds, with their headers and byte pieces in its page (INT-2).

    The header binds the cell's place and size: the tensor, sub-block, unit
    run, the rows of its chunk, its bytes and the bytes taken (all of them, or
    in partial mode ``ceil(partial_bytes / C)`` for a page of ``C`` cells, at
    its ends: :func:`get_partial_ranges`). The layer and the position are bound
    when a page is digested (:func:`digest_cell`). The chunk's first row is
    not: the position says which tokens it holds, so a page of 32 tokens and
    two pages of 16 give the same cells.
    """
    cells = get_digest_cells(page, split=split, granule=granule)
    take = None if partial_bytes is None else -(-partial_bytes // len(cells))
    planned = []
    for cell in cells:
        tensor = page.tensors[cell.tensor]
        if get_counting_rank(tensor.sub_blocks[cell.sub_block], cell.first_unit, tp_size=tp_size) != tp_rank:
            continue
        pieces = _cell_pieces(page, cell, tp_size, tp_rank)
        taken = cell.nbytes
        if take is not None:
            ranges = get_partial_ranges(cell.nbytes, take)
            pieces = tuple(_select(pieces, ranges))
            taken = sum(n for _, n in ranges)
        header = struct.pack(
            "<IIIIIQQ", cell.tensor, cell.sub_block, cell.first_unit, cell.units, cell.rows, cell.nbytes, taken
        )
        row_offset = cell.first_row if tensor.token_rows else None
        planned.append(PlannedCell(cell=cell, header=header, pieces=pieces, row_offset=row_offset))
    return tuple(planned)


def get_partial_ranges(nbytes: int, take: int) -> tuple[tuple[int, int], ...]:
    """The ``(start, nbytes)`` ranges of a cell of ``nbytes`` that partial mode digests: ``take`` bytes, half at each end (INT-2)."""  # noqa: E501
    if take >= nbytes:
        return ((0, nbytes),)
    head = (take + 1) // 2
    return ((0, head), (nbytes - (take - head), take - head))


def _select(pieces: Sequence[tuple[int, int]], ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``pieces`` (a cell's bytes, in order) that ``ranges`` (cell coordinates) pick."""
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        at, cell_at = start, 0
        end = start + length
        for offset, size in pieces:
            lo, hi = max(at, cell_at), min(end, cell_at + size)
            if lo < hi:
                out.append((offset + lo - cell_at, hi - lo))
            cell_at += size
    return out


def digest_cell(algorithm: DigestAlgorithm, planned: PlannedCell, data: Buffer, *, prefix: bytes, position: int) -> int:
    """One cell's digest as a 128-bit int: the hash of its header, then its bytes (INT-2).

    The header is ``prefix`` (:func:`get_layer_prefix`: ``kvspec-INT-2`` and
    the layer name), ``position`` (8 bytes: the first token the cell holds, or
    the page's index for a page whose rows are not tokens) and the planned
    header (:func:`get_digest_plan`); the body is the planned pieces of
    ``data``, in order. XXH3-128: the 128-bit XXH3 of the body with seed the
    64-bit XXH3 of the header (two headers share a seed with probability
    ``2**-64``). BLAKE2b-128: BLAKE2b (16-byte digest) of header then body,
    its bytes read little-endian. Integers in the header are little-endian.
    """
    head = prefix + position.to_bytes(8, "little") + planned.header
    pieces = planned.pieces
    if algorithm is DigestAlgorithm.XXH3_128 and xxhash is not None:
        # One call over the bytes, seeded by the header: XXH3's streaming form costs twice as much (INT-2).
        body = data[pieces[0][0] : pieces[0][0] + pieces[0][1]] if len(pieces) == 1 else _join(data, pieces)
        return xxhash.xxh3_128_intdigest(body, seed=xxhash.xxh3_64_intdigest(head))
    if algorithm is not DigestAlgorithm.BLAKE2B_128:
        raise ConfigError(f"algorithm: {algorithm.value} needs the xxhash package (pip install xxhash) (INT-2)")
    b = hashlib.blake2b(head, digest_size=16)
    for offset, n in pieces:
        b.update(data[offset : offset + n])
    return int.from_bytes(b.digest(), "little")


def _join(data: Buffer, pieces: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(data[offset : offset + n] for offset, n in pieces)


def get_layer_prefix(layer: str) -> bytes:
    """``kvspec-INT-2``, the layer name's UTF-8 length (4 bytes, little-endian) and bytes: every cell's first bytes (INT-2)."""  # noqa: E501
    name = layer.encode("utf-8")
    return _PERSON + len(name).to_bytes(4, "little") + name


def digest_rank_page(
    policy: DigestPolicy,
    page: CanonicalPage,
    data: Buffer,
    *,
    layer: str,
    position: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    split: int = 1,
    granule: int,
) -> dict[int, int]:
    """One rank's digests of its page of one layer: chunk position -> sum of the cells it adds there (INT-2).

    ``data`` is the rank's physical page (PAR-2) of ``layer``; ``position`` the
    first token the page holds (a token page) or its index (any other page). A
    cell's position is ``position + first_row`` for a token tensor, and
    ``position`` otherwise. Sum these maps over layers, pages and ranks with
    :func:`combine_digests`; equal totals on both sides mean equal bytes.
    """
    partial = policy.partial_bytes if policy.mode is DigestMode.PARTIAL else None
    plan = get_digest_plan(page, tp_size=tp_size, tp_rank=tp_rank, split=split, granule=granule, partial_bytes=partial)
    return digest_planned_page(policy.algorithm, plan, data, prefix=get_layer_prefix(layer), position=position)


def digest_planned_page(
    algorithm: DigestAlgorithm, plan: Sequence[PlannedCell], data: Buffer, *, prefix: bytes, position: int
) -> dict[int, int]:
    """:func:`digest_rank_page` with the plan and layer prefix kept by the caller: one page at engine speed (INT-2)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    out: dict[int, int] = {}
    for planned in plan:
        at = position if planned.row_offset is None else position + planned.row_offset
        value = digest_cell(algorithm, planned, view, prefix=prefix, position=at)
        out[at] = (out.get(at, 0) + value) % DIGEST_MODULUS
    return out


def combine_digests(maps: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """Add digest maps position by position, modulo 2**128: over layers, pages, TP ranks and PP stages (INT-2)."""
    total: dict[int, int] = {}
    for found in maps:
        for position, value in found.items():
            total[position] = (total.get(position, 0) + value) % DIGEST_MODULUS
    return dict(sorted(total.items()))


def check_digests(
    request_id: str,
    held: Mapping[int, int],
    received: Mapping[int, int],
    *,
    group: int = 0,
    granule: int | None = None,
) -> None:
    """Raise :class:`IntegrityMismatchError` naming the first position whose sums differ (INT-2).

    ``held`` is the producer's total, ``received`` the consumer's. A position
    only one side has differs too. The page is named as ``group g, tokens
    [p, p + granule)`` (or ``group g, page p`` without a granule).
    """
    for position in sorted(set(held) | set(received)):
        if held.get(position) != received.get(position):
            page = (
                f"group {group}, page {position}"
                if granule is None
                else (f"group {group}, tokens [{position}, {position + granule})")
            )
            raise IntegrityMismatchError(
                f"request {request_id!r}: {page}: the consumer's digest "
                f"{_shown(received.get(position))} differs from the producer's {_shown(held.get(position))} (INT-2)",
                rule="INT-2",
                request_id=request_id,
                page=page,
            )


def _shown(value: int | None) -> str:
    return "none" if value is None else format_digest(value)


def format_digest(value: int) -> str:
    """A digest's text form: 32 lowercase hex characters, big-endian (INT-2)."""
    return f"{value % DIGEST_MODULUS:032x}"


_HEX = frozenset("0123456789abcdef")


def parse_digest(text: object, *, field: str) -> int:
    """A digest from its text form; anything but 32 lowercase hex characters raises :class:`MalformedMessageError` (INT-2)."""  # noqa: E501
    if not isinstance(text, str) or len(text) != 32 or not _HEX.issuperset(text):
        shown = repr(text)[:60]
        raise MalformedMessageError(f"expected 32 lowercase hex characters (INT-2), got {shown}", field=field)
    return int(text, 16)
