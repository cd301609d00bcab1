"""Testing helpers: shared-memory page pools, pages keyed by logical position, and the page oracle.

This module is public and supported: the conformance suite is built on it and
connector authors may use it in their own tests. The oracle reads both pools
directly and never trusts what a backend reports (docs/explanation/suite-limits.md).

Theory of operation:

1. :func:`allocate_pool` gives one :class:`kvspec.transport.MemoryRegion` per
   :class:`kvspec.KVCacheTensor`, backed by ``multiprocessing.shared_memory``
   so that an agent in another process can attach the same bytes.
2. :func:`fill_background` writes role-keyed noise over a whole pool, so that
   any stray write, even of zeros, changes some byte.
3. :func:`fill_producer_pages` writes, into each of the producer's blocks,
   bytes keyed by ``(salt, group, layer index, logical block position)``
   (:func:`expected_page`). A page that lands in the wrong block, group, layer
   or request is caught, because its bytes belong to another key.
4. Take :meth:`PagePool.snapshot` of both pools, run the scenario, then
   :func:`check_pools` with one :class:`ExpectedLoad` per request. It checks
   every page of both pools: each paired consumer page holds the producer's
   page for the same logical position, every other byte is untouched, and the
   producer pool is not modified at all. Of a state group's page only the
   state tensors' bytes travel (PLAN-1): the consumer's padding after them
   must stay as it was.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import random
import secrets
from collections.abc import Iterator, Sequence
from multiprocessing import shared_memory
from types import TracebackType
from typing import TYPE_CHECKING

import attrs

from kvspec.core._deprecation import moved_names
from kvspec.core._errors import ConfigError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig
from kvspec.spec.plan import get_page_byte_ranges
from kvspec.transport._base import MemoryRegion

__all__ = [
    "ExpectedLoad",
    "ExpectedPair",
    "MismatchKind",
    "PageMismatch",
    "PagePool",
    "PoolSnapshot",
    "allocate_pool",
    "check_loaded_pages",
    "check_pools",
    "expected_page",
    "expected_pairs",
    "fill_background",
    "fill_producer_pages",
    "format_mismatches",
    "logical_positions",
]

# Keyed bytes repeat with a prime period so that generating large pages stays
# cheap; a shift inside one page by a multiple of this many bytes is not seen.
_PERIOD = 4099


def _seed(*parts: object) -> int:
    text = ":".join(str(p) for p in ("kvspec", *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _keyed_bytes(nbytes: int, *parts: object) -> bytes:
    pattern = random.Random(_seed(*parts)).randbytes(min(nbytes, _PERIOD))
    if nbytes <= len(pattern):
        return pattern
    reps = -(-nbytes // len(pattern))
    return (pattern * reps)[:nbytes]


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


# --------------------------------------------------------------------------- pools


@attrs.frozen(kw_only=True)
class PoolSnapshot:
    """A copy of every region of one pool, taken by the suite, not the backend."""

    regions: tuple[bytes, ...]


class PagePool:
    """One engine's KV-cache memory: a :class:`MemoryRegion` per tensor of ``config``.

    Use as a context manager, or call :meth:`close`; shared-memory blocks are
    unlinked on close even when a backend still holds views of them.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        regions: Sequence[MemoryRegion],
        *,
        _owned: Sequence[shared_memory.SharedMemory] = (),
    ) -> None:
        if len(regions) != len(config.kv_cache_tensors):
            raise ConfigError(
                f"PagePool.regions: expected {len(config.kv_cache_tensors)} regions, one per tensor, got {len(regions)}"
            )
        for index, (region, tensor) in enumerate(zip(regions, config.kv_cache_tensors, strict=True)):
            if region.nbytes < tensor.size:
                raise ConfigError(
                    f"PagePool.regions[{index}]: expected at least {tensor.size} bytes, got {region.nbytes}"
                )
        self.config = config
        self.regions: tuple[MemoryRegion, ...] = tuple(regions)
        self._owned = list(_owned)
        self.closed = False

    @classmethod
    def from_regions(cls, config: KVCacheConfig, regions: Sequence[MemoryRegion]) -> PagePool:
        """Wrap regions someone else owns; :meth:`close` then leaves them alone."""
        return cls(config, regions)

    @property
    def shm_names(self) -> tuple[str | None, ...]:
        """The shared-memory name of each region (``None`` for private memory)."""
        return tuple(region.shm_name for region in self.regions)

    def page(self, layer_name: str, block_id: int) -> memoryview:
        """A writable view of one page (PLAN-1)."""
        tensor_index, offset = self.config.page_offset(layer_name, block_id)
        size = self._page_size(layer_name)
        return self.regions[tensor_index].buffer[offset : offset + size]

    def _page_size(self, layer_name: str) -> int:
        for group in self.config.kv_cache_groups:
            if layer_name in group.layer_names:
                return group.kv_cache_spec.page_size_bytes
        raise ConfigError(f"PagePool.page: layer {layer_name!r} is in no group")

    def snapshot(self) -> PoolSnapshot:
        """Copy every region's bytes."""
        return PoolSnapshot(regions=tuple(bytes(region.buffer) for region in self.regions))

    def close(self) -> None:
        """Release and unlink the shared memory this pool allocated; idempotent."""
        if self.closed:
            return
        self.closed = True
        for region in self.regions:
            if self._owned:
                # A view still exported by a backend keeps the mapping; unlink still frees the name.
                with contextlib.suppress(BufferError):
                    region.buffer.release()
        for shm in self._owned:
            with contextlib.suppress(BufferError):
                shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        self._owned.clear()

    def __enter__(self) -> PagePool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PagePool(num_blocks={self.config.num_blocks}, shm_names={self.shm_names!r})"


def allocate_pool(config: KVCacheConfig, *, shared: bool = True, prefix: str = "kvspec") -> PagePool:
    """Allocate zeroed memory for every tensor of ``config``.

    With ``shared`` (the default) each region is a ``multiprocessing.shared_memory``
    block whose name is in ``MemoryRegion.shm_name``, so a backend agent in
    another process can attach it; otherwise the regions are private ``bytearray``.
    """
    regions: list[MemoryRegion] = []
    owned: list[shared_memory.SharedMemory] = []
    try:
        for tensor in config.kv_cache_tensors:
            if shared:
                shm = shared_memory.SharedMemory(name=f"{prefix}_{secrets.token_hex(6)}", create=True, size=tensor.size)
                owned.append(shm)
                assert shm.buf is not None  # a freshly created block is always mapped
                buffer = shm.buf[: tensor.size]
                buffer[:] = bytes(tensor.size)
                regions.append(MemoryRegion(buffer=buffer, shm_name=shm.name))
            else:
                regions.append(MemoryRegion(buffer=memoryview(bytearray(tensor.size))))
    except BaseException:
        for shm in owned:
            shm.unlink()
        raise
    return PagePool(config, regions, _owned=owned)


# --------------------------------------------------------------------------- keyed pages


def fill_background(pool: PagePool, *, seed: int | str) -> None:
    """Overwrite every byte of ``pool`` with noise keyed by ``seed`` and region index."""
    for index, region in enumerate(pool.regions):
        region.buffer[:] = _keyed_bytes(region.nbytes, "background", seed, index)


def expected_page(
    config: KVCacheConfig,
    *,
    group: int,
    layer_index: int,
    position: int,
    salt: int | str = 0,
) -> bytes:
    """The bytes the producer's page for one logical block position holds.

    Keyed by ``(salt, group, layer index in the group, logical block position)``;
    the layer index (not its name) is the key because HS-1 pairs layers by order.
    """
    size = config.kv_cache_groups[group].kv_cache_spec.page_size_bytes
    return _keyed_bytes(size, "page", salt, group, layer_index, position)


def _moved_bytes(config: KVCacheConfig, group: int) -> int:
    """Bytes at the start of each page of ``group`` that a transfer moves: the page, or a state group's tensors.

    The oracle's own arithmetic from the shapes (PLAN-1), not the planner's.
    """
    spec = config.kv_cache_groups[group].kv_cache_spec
    ranges = get_page_byte_ranges(spec)
    end = ranges[-1][0] + ranges[-1][1]
    if sum(nbytes for _, nbytes in ranges) != end or ranges[0][0] != 0:
        raise ConfigError(f"group {group}: the oracle expects the moved bytes of a page as one run from its start")
    return end


def logical_positions(
    config: KVCacheConfig, block_ids: BlockIds, *, num_tokens: int, block_ends: Sequence[int] | None = None
) -> list[list[int]]:
    """Logical block position of every id: each group's list ends at block ``cdiv(T, B_g) - 1`` (WIN-1).

    ``block_ends`` (protocol 1.1, ALIGN-1) are where the lists say they end
    instead: group g's last id sits at logical block ``block_ends[g] - 1``.
    An empty ``block_ids`` (zero groups, a full prefix hit) gives ``[]``.
    """
    if len(block_ids) == 0:
        return []
    if len(block_ids) != config.num_groups:
        raise ConfigError(f"logical_positions: expected {config.num_groups} groups, got {len(block_ids)}")
    if block_ends is not None and len(block_ends) != config.num_groups:
        raise ConfigError(f"logical_positions: expected {config.num_groups} block ends, got {len(block_ends)}")
    positions: list[list[int]] = []
    for g, (group, ids) in enumerate(zip(config.kv_cache_groups, block_ids, strict=True)):
        end = -(-num_tokens // group.kv_cache_spec.block_size) if block_ends is None else block_ends[g]
        positions.append([end - len(ids) + i for i in range(len(ids))])
    return positions


def fill_producer_pages(
    pool: PagePool,
    producer_block_ids: BlockIds,
    *,
    num_tokens: int,
    salt: int | str = 0,
    block_ends: Sequence[int] | None = None,
) -> None:
    """Write :func:`expected_page` into every page of the producer's real blocks (NULL-1: id 0 is skipped).

    Each page is keyed by its id's logical position: by ``block_ends`` where
    the list says where it ends (protocol 1.1), else at the request's last block.
    """
    config = pool.config
    positions_of = logical_positions(config, producer_block_ids, num_tokens=num_tokens, block_ends=block_ends)
    for g, (ids, positions) in enumerate(zip(producer_block_ids, positions_of, strict=True)):
        layers = config.kv_cache_groups[g].layer_names
        for block_id, position in zip(ids, positions, strict=True):
            if block_id == NULL_BLOCK_ID:
                continue
            for layer_index, layer in enumerate(layers):
                pool.page(layer, block_id)[:] = expected_page(
                    config, group=g, layer_index=layer_index, position=position, salt=salt
                )


# --------------------------------------------------------------------------- expectations


@attrs.frozen(kw_only=True)
class ExpectedPair:
    """One block pair the transfer must move: every layer of ``group`` (ALIGN-1, PLAN-1).

    Not to be confused with :class:`kvspec.PageCopy`, the planner's byte-range copy.
    """

    group: int
    position: int
    producer_block: int
    consumer_block: int


@attrs.frozen(kw_only=True)
class ExpectedLoad:
    """What one request should have done to the consumer's pool.

    ``producer_block_ids`` is what P advertised (after clipping) and
    ``consumer_block_ids`` C's uncached suffix (after clipping), both as the
    engines hold them. ``loaded`` is False for a request that failed or was
    aborted: its paired consumer pages may then hold anything (FAIL-1), but
    nothing else may change. ``producer_block_ends`` / ``consumer_block_ends``
    place a list by where it really ends (protocol 1.1); ``None`` places it
    at the request's last block.
    """

    producer_block_ids: BlockIds = attrs.field(converter=BlockIds)
    consumer_block_ids: BlockIds = attrs.field(converter=BlockIds)
    num_tokens: int
    salt: int | str = 0
    loaded: bool = True
    producer_block_ends: tuple[int, ...] | None = None
    consumer_block_ends: tuple[int, ...] | None = None


def expected_pairs(config: KVCacheConfig, load: ExpectedLoad) -> list[ExpectedPair]:
    """The pairs the oracle expects, computed independently of kvspec's reference and planner.

    Each of C's ids pairs with P's id of the same logical position (WIN-1):
    each list ends at block ``cdiv(T, B_g) - 1``, or where its ends say. With
    no ends that is C's i-th id with P's id at ``len(P[g]) - len(C[g]) + i``
    (tail alignment, ALIGN-1). Pairs with a null or missing side are dropped
    (NULL-1). A zero-group consumer list (full prefix hit) expects no copy.
    """
    if len(load.consumer_block_ids) == 0:
        return []
    if len(load.consumer_block_ids) != config.num_groups or len(load.producer_block_ids) != config.num_groups:
        raise ConfigError(
            f"ExpectedLoad: expected {config.num_groups} groups, got producer {len(load.producer_block_ids)} "
            f"and consumer {len(load.consumer_block_ids)}"
        )
    positions = logical_positions(
        config, load.consumer_block_ids, num_tokens=load.num_tokens, block_ends=load.consumer_block_ends
    )
    producer_positions = logical_positions(
        config, load.producer_block_ids, num_tokens=load.num_tokens, block_ends=load.producer_block_ends
    )
    copies: list[ExpectedPair] = []
    for g, (p_ids, c_ids) in enumerate(zip(load.producer_block_ids, load.consumer_block_ids, strict=True)):
        by_position = dict(zip(producer_positions[g], p_ids, strict=True))
        for i, c_block in enumerate(c_ids):
            p_block = by_position.get(positions[g][i], NULL_BLOCK_ID)
            if c_block == NULL_BLOCK_ID or p_block == NULL_BLOCK_ID:
                continue
            copies.append(
                ExpectedPair(group=g, position=positions[g][i], producer_block=p_block, consumer_block=c_block)
            )
    return copies


class MismatchKind(str, enum.Enum):
    """How a page differs from what the oracle expects."""

    NOT_WRITTEN = "not_written"  # a paired consumer page still holds its old bytes
    WRONG_CONTENT = "wrong_content"  # a paired consumer page holds other bytes
    STRAY_WRITE = "stray_write"  # a page nobody should touch changed
    OUTSIDE_PAGES = "outside_pages"  # bytes between or after pages changed
    PRODUCER_MODIFIED = "producer_modified"  # the producer's pool changed


@attrs.frozen(kw_only=True)
class PageMismatch:
    """One page (or byte range) that differs from the oracle's expectation (docs/explanation/suite-limits.md)."""

    side: str  # "producer" or "consumer"
    kind: MismatchKind
    group: int | None
    layer: str | None
    block: int | None
    what: str

    def __str__(self) -> str:
        where = f"group {self.group}, layer {self.layer!r}, block {self.block}" if self.group is not None else "-"
        return f"{self.side}: {where}: {self.what}"


def format_mismatches(mismatches: Sequence[PageMismatch], *, limit: int = 10) -> str:
    """Render mismatches one per line, at most ``limit`` of them."""
    lines = [str(m) for m in mismatches[:limit]]
    if len(mismatches) > limit:
        lines.append(f"... and {len(mismatches) - limit} more")
    return "\n".join(lines)


def _pages(config: KVCacheConfig) -> Iterator[tuple[int, int, str, int, int, int]]:
    """Every page: (group, layer index, layer name, block, tensor index, offset)."""
    for g, group in enumerate(config.kv_cache_groups):
        for layer_index, layer in enumerate(group.layer_names):
            for block in range(config.num_blocks):
                tensor_index, offset = config.page_offset(layer, block)
                yield g, layer_index, layer, block, tensor_index, offset


def _describe(data: bytes, labels: dict[bytes, str]) -> str:
    return labels.get(_digest(data), "unrecognised bytes")


def _producer_labels(producer: PagePool, before: PoolSnapshot, loads: Sequence[ExpectedLoad]) -> dict[bytes, str]:
    """Digest -> description of every keyed page of the scenario and every page the producer holds."""
    labels: dict[bytes, str] = {}
    config = producer.config
    for load in loads:
        if len(load.producer_block_ids) != config.num_groups:
            continue
        positions = logical_positions(
            config, load.producer_block_ids, num_tokens=load.num_tokens, block_ends=load.producer_block_ends
        )
        for g, (ids, group_positions) in enumerate(zip(load.producer_block_ids, positions, strict=True)):
            for block, position in zip(ids, group_positions, strict=True):
                moved = _moved_bytes(config, g)
                for layer_index, layer in enumerate(config.kv_cache_groups[g].layer_names):
                    page = expected_page(config, group=g, layer_index=layer_index, position=position, salt=load.salt)
                    page = page[:moved]
                    labels.setdefault(
                        _digest(page),
                        f"the page of group {g}, layer {layer!r}, position {position}, salt {load.salt!r}"
                        f" (producer block {block})",
                    )
    for g, _, layer, block, tensor_index, offset in _pages(config):
        size = _moved_bytes(config, g)
        page = before.regions[tensor_index][offset : offset + size]
        labels.setdefault(_digest(page), f"the producer's block {block} of group {g}, layer {layer!r}")
    return labels


def _expected_pages(
    config: KVCacheConfig, loads: Sequence[ExpectedLoad]
) -> tuple[dict[tuple[int, int], tuple[bytes, str]], dict[tuple[int, int], int]]:
    """Consumer pages with a defined content ((tensor, offset) -> bytes, description), and undefined ones (-> size).

    The bytes are those a transfer moves: the whole page, or a state group's
    tensors (the padding after them keeps its old bytes, PLAN-1).
    """
    expected: dict[tuple[int, int], tuple[bytes, str]] = {}
    undefined: dict[tuple[int, int], int] = {}
    for load in loads:
        for copy in expected_pairs(config, load):
            moved = _moved_bytes(config, copy.group)
            for layer_index, layer in enumerate(config.kv_cache_groups[copy.group].layer_names):
                key = config.page_offset(layer, copy.consumer_block)
                expected.pop(key, None)
                undefined.pop(key, None)
                if not load.loaded:
                    undefined[key] = moved
                    continue
                page = expected_page(
                    config, group=copy.group, layer_index=layer_index, position=copy.position, salt=load.salt
                )[:moved]
                desc = f"the page of group {copy.group}, layer {layer!r}, position {copy.position}, salt {load.salt!r}"
                expected[key] = (page, desc)
    return expected, undefined


def check_loaded_pages(consumer: PagePool, load: ExpectedLoad) -> list[PageMismatch]:
    """Check only the paired pages of one request, e.g. the moment it is reported complete (DONE-1)."""
    config = consumer.config
    expected, _ = _expected_pages(config, [attrs.evolve(load, loaded=True)])
    found: list[PageMismatch] = []
    for copy in expected_pairs(config, load):
        for layer in config.kv_cache_groups[copy.group].layer_names:
            tensor_index, offset = config.page_offset(layer, copy.consumer_block)
            page, desc = expected[(tensor_index, offset)]
            got = bytes(consumer.regions[tensor_index].buffer[offset : offset + len(page)])
            if got != page:
                found.append(
                    PageMismatch(
                        side="consumer",
                        kind=MismatchKind.WRONG_CONTENT,
                        group=copy.group,
                        layer=layer,
                        block=copy.consumer_block,
                        what=f"expected {desc}, but it is not there yet",
                    )
                )
    return found


def check_pools(
    *,
    producer: PagePool,
    consumer: PagePool,
    producer_before: PoolSnapshot,
    consumer_before: PoolSnapshot,
    loads: Sequence[ExpectedLoad],
) -> list[PageMismatch]:
    """Compare every page of both pools with what ``loads`` should have done.

    ``loads`` apply in order: when a consumer block is reused, the later
    request's expectation replaces the earlier one's.

    - Producer pool: byte-identical to ``producer_before`` (neither mode writes P).
    - Consumer pool: each paired page of a loaded request holds
      :func:`expected_page` for its group, layer and logical position
      (ALIGN-1, NULL-1, PLAN-1, DONE-1); paired pages of failed requests may
      hold anything (FAIL-1); every other byte equals ``consumer_before``
      (prefix-hit blocks, the null block, other requests' blocks, padding).

    Returns the mismatches, empty when the pools are right. Both configs are
    read from the pools; groups and layers pair by index (HS-1).
    """
    mismatches: list[PageMismatch] = []
    config = consumer.config
    expected, undefined = _expected_pages(config, loads)
    labels: dict[bytes, str] | None = None

    def label(data: bytes) -> str:
        nonlocal labels
        if labels is None:
            labels = _producer_labels(producer, producer_before, loads)
        return _describe(data, labels)

    # Producer: untouched, byte for byte.
    for index, (region, old) in enumerate(zip(producer.regions, producer_before.regions, strict=True)):
        if bytes(region.buffer[: len(old)]) != old:
            mismatches.extend(_locate_changes(producer.config, index, old, bytes(region.buffer), "producer"))

    # Consumer: build the expected image of each region, then compare.
    images = [bytearray(old) for old in consumer_before.regions]
    for (tensor_index, offset), (page, _) in expected.items():
        images[tensor_index][offset : offset + len(page)] = page
    actual = [
        bytes(region.buffer[: len(old)]) for region, old in zip(consumer.regions, consumer_before.regions, strict=False)
    ]
    for (tensor_index, offset), size in undefined.items():
        # A failed request's paired pages may hold anything (FAIL-1).
        images[tensor_index][offset : offset + size] = actual[tensor_index][offset : offset + size]
    for index, (image, now) in enumerate(zip(images, actual, strict=True)):
        if bytes(image) == now:
            continue
        found_before = len(mismatches)
        for g, _, layer, block, tensor_index, offset in _pages(config):
            if tensor_index != index:
                continue
            size = config.kv_cache_groups[g].kv_cache_spec.page_size_bytes
            got = now[offset : offset + size]
            if got == image[offset : offset + size]:
                continue
            old = consumer_before.regions[index][offset : offset + size]
            moved = _moved_bytes(config, g)
            if (index, offset) in expected:
                want = expected[(index, offset)][1]
                if got == old:
                    kind, what = MismatchKind.NOT_WRITTEN, f"expected {want}, but it was never written"
                elif got[:moved] == image[offset : offset + moved]:
                    kind = MismatchKind.WRONG_CONTENT
                    what = (
                        f"holds {want}, but the {size - moved} padding bytes after the state tensors changed; "
                        "only the state tensors' bytes travel (PLAN-1)"
                    )
                else:
                    kind, what = MismatchKind.WRONG_CONTENT, f"expected {want}, found {label(got[:moved])}"
            else:
                kind, what = MismatchKind.STRAY_WRITE, f"must be untouched, but now holds {label(got[:moved])}"
            mismatches.append(PageMismatch(side="consumer", kind=kind, group=g, layer=layer, block=block, what=what))
        if len(mismatches) == found_before:
            first = next(i for i, (a, b) in enumerate(zip(image, now, strict=False)) if a != b)
            mismatches.append(
                PageMismatch(
                    side="consumer",
                    kind=MismatchKind.OUTSIDE_PAGES,
                    group=None,
                    layer=None,
                    block=None,
                    what=f"region {index}: byte {first} outside every page changed",
                )
            )
    return mismatches


def _locate_changes(config: KVCacheConfig, index: int, old: bytes, now: bytes, side: str) -> list[PageMismatch]:
    found: list[PageMismatch] = []
    for g, _, layer, block, tensor_index, offset in _pages(config):
        if tensor_index != index:
            continue
        size = config.kv_cache_groups[g].kv_cache_spec.page_size_bytes
        if old[offset : offset + size] != now[offset : offset + size]:
            found.append(
                PageMismatch(
                    side=side,
                    kind=MismatchKind.PRODUCER_MODIFIED,
                    group=g,
                    layer=layer,
                    block=block,
                    what="the producer's page changed; no transfer may write the producer's pool",
                )
            )
    if not found:
        first = next(i for i, (a, b) in enumerate(zip(old, now, strict=False)) if a != b)
        found.append(
            PageMismatch(
                side=side,
                kind=MismatchKind.PRODUCER_MODIFIED,
                group=None,
                layer=None,
                block=None,
                what=f"region {index}: byte {first} outside every page changed",
            )
        )
    return found


# Renamed in 0.2.0; the old names work, with a DeprecationWarning, until 0.3.0.
if not TYPE_CHECKING:  # hidden from type checkers, which then flag the old names
    __getattr__ = moved_names(
        "kvspec.testing",
        {
            "PageCopy": ("kvspec.testing", "ExpectedPair", "kvspec.testing.ExpectedPair"),
            "expected_copies": ("kvspec.testing", "expected_pairs", "kvspec.testing.expected_pairs"),
        },
    )
