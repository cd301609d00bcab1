"""Descriptor lists: the planner's output and every backend's input, with the one bounds check and run merge.

This module sits below the planner and the transports (docs/explanation/layers.md):
:meth:`kvspec.TransferPlan.to_descriptors` builds a :class:`DescriptorList`, and
every backend validates one with :func:`check_descriptors` and merges one with
:func:`merge_runs`, so the three backends refuse the same lists with the same
message and move the same runs (PLAN-1).
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, TypeAlias, overload

import attrs

from kvspec.core._errors import ConfigError, PlanError

__all__ = [
    "Descriptor",
    "DescriptorBounds",
    "DescriptorList",
    "check_descriptors",
    "merge_columns",
    "merge_runs",
]

_Column: TypeAlias = Any
"""One column of ints: a list, an ``array('q')`` or a numpy int64 array."""


@attrs.frozen(kw_only=True)
class Descriptor:
    """One contiguous copy between the initiator's region and the peer's region.

    ``local_*`` is on the agent that posts; ``remote_*`` on the peer. For READ
    bytes go remote -> local, for WRITE local -> remote. Region indexes are
    registration order on each side.
    """

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    nbytes: int


@attrs.frozen(kw_only=True)
class DescriptorBounds:
    """The extremes of a :class:`DescriptorList`, computed once when it is built.

    They let a backend prove that every descriptor falls inside the registered
    regions (PLAN-1) without looking at each one: :meth:`fits` answers from
    six numbers. When it answers ``False``, the list may still be valid (the
    regions differ in size) and the backend checks it row by row.
    """

    count: int  # descriptors in the list
    smallest: int  # the smallest value of any field of any descriptor
    smallest_nbytes: int
    largest_nbytes: int
    regions: tuple[int, int]  # the largest local and remote region index
    ends: tuple[int, int]  # the largest local and remote offset + nbytes

    def fits(self, local_sizes: Sequence[int], remote_sizes: Sequence[int]) -> bool:
        """Whether every descriptor lies inside the smallest region on each side (so inside its own)."""
        return not self.count or (
            self.smallest >= 0
            and self.smallest_nbytes > 0
            and self.regions[0] < len(local_sizes)
            and self.regions[1] < len(remote_sizes)
            and self.ends[0] <= min(local_sizes)
            and self.ends[1] <= min(remote_sizes)
        )


_COLUMNS = ("local_region", "local_offset", "remote_region", "remote_offset", "nbytes")
_GETTERS = tuple(map(attrgetter, _COLUMNS))


class DescriptorList(Sequence[Descriptor]):
    """An immutable list of descriptors packed as five int64 columns.

    It is a ``Sequence[Descriptor]``, so every backend can take it where it
    takes a list of :class:`Descriptor`; indexing builds a ``Descriptor`` on
    demand. A backend that ships descriptors to another process or to a native
    library reads the columns instead, with no per-descriptor work:
    :meth:`to_bytes` gives ``local_region, local_offset, remote_region,
    remote_offset, nbytes`` as little-endian int64, one column after the
    other. :meth:`kvspec.TransferPlan.to_descriptors` returns one.

    >>> d = DescriptorList.from_columns(
    ...     local_region=[0, 0], local_offset=[0, 4096],
    ...     remote_region=[1, 1], remote_offset=[8192, 0],
    ...     nbytes=[4096, 4096],
    ... )
    >>> len(d), d[1].remote_offset, d.total_bytes
    (2, 0, 8192)
    """

    __slots__ = ("_bounds", "_count", "_data")
    _data: array[int]
    _count: int
    _bounds: DescriptorBounds

    def __init__(self, descriptors: Iterable[Descriptor] = ()) -> None:
        """Pack ``descriptors`` (any iterable of :class:`Descriptor`)."""
        if isinstance(descriptors, DescriptorList):
            self._data, self._count, self._bounds = descriptors._data, descriptors._count, descriptors._bounds
            return
        rows = descriptors if isinstance(descriptors, Sequence) else list(descriptors)
        try:
            # One C-level pass per field: the cheapest way found to unpack objects (benchmarks/bench_engine.py).
            self._init([list(map(getter, rows)) for getter in _GETTERS])
        except AttributeError:
            bad = next(row for row in rows if not isinstance(row, Descriptor))
            raise ConfigError(f"DescriptorList: expected Descriptor items, got {bad!r}") from None

    @classmethod
    def of(cls, descriptors: Sequence[Descriptor]) -> DescriptorList:
        """``descriptors`` itself when it is a DescriptorList, else a packed copy (what backends call)."""
        return descriptors if isinstance(descriptors, DescriptorList) else cls(descriptors)

    @classmethod
    def from_columns(
        cls,
        *,
        local_region: Sequence[int],
        local_offset: Sequence[int],
        remote_region: Sequence[int],
        remote_offset: Sequence[int],
        nbytes: Sequence[int],
    ) -> DescriptorList:
        """Build from one sequence of ints per :class:`Descriptor` field, all of the same length."""
        self = cls.__new__(cls)
        self._init([local_region, local_offset, remote_region, remote_offset, nbytes])
        return self

    def _init(self, columns: list[Sequence[int]]) -> None:
        count = len(columns[0])
        data = array("q")
        layout = f"={count}q"  # struct packs a list of ints ~4x faster than array.extend
        for name, column in zip(_COLUMNS, columns, strict=True):
            if len(column) != count:
                raise ConfigError(
                    f"DescriptorList.{name}: expected {count} values (as many as local_region), got {len(column)}"
                )
            try:
                data.frombytes(struct.pack(layout, *column))
            except struct.error as exc:
                raise ConfigError(f"DescriptorList.{name}: expected 64-bit signed ints ({exc})") from None
        self._data, self._count = data, count
        if not count:
            self._bounds = DescriptorBounds(
                count=0, smallest=0, smallest_nbytes=0, largest_nbytes=0, regions=(-1, -1), ends=(0, 0)
            )
            return
        local_region, local_offset, remote_region, remote_offset, nbytes = columns
        self._bounds = DescriptorBounds(
            count=count,
            smallest=min(map(min, columns)),
            smallest_nbytes=min(nbytes),
            largest_nbytes=max(nbytes),
            regions=(max(local_region), max(remote_region)),
            ends=(max(map(operator.add, local_offset, nbytes)), max(map(operator.add, remote_offset, nbytes))),
        )

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Descriptor: ...

    @overload
    def __getitem__(self, index: slice) -> DescriptorList: ...

    def __getitem__(self, index: int | slice) -> Descriptor | DescriptorList:
        if isinstance(index, slice):
            return DescriptorList.from_columns(**{name: self.column(name)[index] for name in _COLUMNS})
        count = self._count
        if not -count <= index < count:
            raise IndexError(f"DescriptorList index {index} out of range for {count} descriptors")
        return self._row(index % count)

    def __iter__(self) -> Iterator[Descriptor]:
        return map(self._row, range(self._count))

    def _row(self, index: int) -> Descriptor:
        data, count = self._data, self._count
        return Descriptor(
            local_region=data[index],
            local_offset=data[count + index],
            remote_region=data[2 * count + index],
            remote_offset=data[3 * count + index],
            nbytes=data[4 * count + index],
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DescriptorList):
            return self._data == other._data
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == self._count and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to lists, which do not hash

    def __repr__(self) -> str:
        return f"DescriptorList({list(self)!r})"

    def column(self, name: str) -> array[int]:
        """A copy of one field's values, in order (``name`` is a :class:`Descriptor` field)."""
        if name not in _COLUMNS:
            raise ConfigError(f"DescriptorList.column: expected one of {', '.join(_COLUMNS)}, got {name!r}")
        start = _COLUMNS.index(name) * self._count
        return self._data[start : start + self._count]

    @property
    def total_bytes(self) -> int:
        """The bytes every descriptor moves, together."""
        return sum(self._data[4 * self._count :])

    @property
    def bounds(self) -> DescriptorBounds:
        """The list's extremes, computed when it was built (see :class:`DescriptorBounds`)."""
        return self._bounds

    def view(self) -> memoryview:
        """The five columns as one read-only memoryview of native-endian int64, without a copy."""
        return memoryview(self._data).toreadonly()

    def to_bytes(self) -> bytes:
        """The five columns as little-endian int64, one after the other (``5 * len(self) * 8`` bytes)."""
        if sys.byteorder == "little":
            return self._data.tobytes()
        swapped = array("q", self._data)
        swapped.byteswap()
        return swapped.tobytes()


# --------------------------------------------------------------------------- shared by every backend


def _describe_bad(index: int, d: Descriptor, local_sizes: Sequence[int], remote_sizes: Sequence[int]) -> str | None:
    if d.nbytes <= 0:
        return f"descriptor {index}: expected nbytes > 0, got {d.nbytes}"
    for side, region, offset, sizes in (
        ("local", d.local_region, d.local_offset, local_sizes),
        ("remote", d.remote_region, d.remote_offset, remote_sizes),
    ):
        if not 0 <= region < len(sizes):
            return f"descriptor {index}: {side} region {region} is not registered ({len(sizes)} regions)"
        if offset < 0 or offset + d.nbytes > sizes[region]:
            return (
                f"descriptor {index}: {side} bytes [{offset}, {offset + d.nbytes}) fall outside "
                f"region {region} of {sizes[region]} bytes"
            )
    return None


def _inside(regions: array[int], offsets: array[int], nbytes: array[int], sizes: Sequence[int]) -> bool:
    # One C-level pass per column: region sizes looked up, ends compared (no per-descriptor Python frame).
    return all(map(operator.le, map(operator.add, offsets, nbytes), map(sizes.__getitem__, regions)))


def check_descriptors(
    descriptors: Sequence[Descriptor], *, local_sizes: Sequence[int], remote_sizes: Sequence[int]
) -> DescriptorList:
    """Return the list packed, or raise :class:`kvspec.PlanError` naming the first descriptor outside (PLAN-1).

    Every descriptor must move at least one byte and lie inside a registered
    region on both sides, so nothing a peer sends can steer a copy outside
    registered memory. The list's bounds settle the usual case at once; a list
    over regions of different sizes is checked column by column.
    """
    try:
        table = DescriptorList.of(descriptors)
    except ConfigError as exc:
        raise PlanError(f"post: expected Descriptor items with 64-bit int fields ({exc})") from None
    bounds = table.bounds
    if bounds.fits(local_sizes, remote_sizes):
        return table
    if (
        bounds.smallest >= 0
        and bounds.smallest_nbytes > 0
        and bounds.regions[0] < len(local_sizes)
        and bounds.regions[1] < len(remote_sizes)
    ):
        nbytes = table.column("nbytes")
        if _inside(table.column("local_region"), table.column("local_offset"), nbytes, local_sizes) and _inside(
            table.column("remote_region"), table.column("remote_offset"), nbytes, remote_sizes
        ):
            return table
    for index, d in enumerate(table):
        problem = _describe_bad(index, d, local_sizes, remote_sizes)
        if problem is not None:
            raise PlanError(problem)
    return table  # unreachable: the column checks and the row checks agree


def merge_runs(descriptors: Sequence[Descriptor]) -> DescriptorList:
    """Merge each descriptor that continues the previous one on both sides into one run (PLAN-1).

    Order is kept; only neighbours merge, so a list sorted by the planner
    merges fully. The bytes moved are the same, in fewer, larger copies.
    """
    table = DescriptorList.of(descriptors)
    if len(table) < 2:
        return table
    lr, lo, rr, ro, nbytes = merge_columns(*(table.column(name) for name in _COLUMNS))
    if len(nbytes) == len(table):
        return table
    return DescriptorList.from_columns(
        local_region=lr, local_offset=lo, remote_region=rr, remote_offset=ro, nbytes=nbytes
    )


def merge_columns(lr: _Column, lo: _Column, rr: _Column, ro: _Column, nbytes: _Column) -> tuple[_Column, ...]:
    """:func:`merge_runs` on five columns; numpy arrays (NIXL's worker) take a vectorised path, same result.

    Row ``i + 1`` joins row ``i``'s run when both sides stay in the same
    region and start where row ``i`` ends (PLAN-1).
    """
    if hasattr(nbytes, "dtype"):  # numpy arrays: one pass per column, no Python loop per row
        np: Any = sys.modules["numpy"]
        if not len(nbytes):
            return lr, lo, rr, ro, nbytes
        follows = (
            (lr[1:] == lr[:-1])
            & (rr[1:] == rr[:-1])
            & (lo[1:] == lo[:-1] + nbytes[:-1])
            & (ro[1:] == ro[:-1] + nbytes[:-1])
        )
        starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(~follows) + 1))
        return lr[starts], lo[starts], rr[starts], ro[starts], np.add.reduceat(nbytes, starts)
    runs: list[list[int]] = []
    last: list[int] = []
    for row in zip(lr, lo, rr, ro, nbytes, strict=True):
        if (
            last
            and last[0] == row[0]
            and last[2] == row[2]
            and last[1] + last[4] == row[1]
            and last[3] + last[4] == row[3]
        ):
            last[4] += row[4]
        else:
            last = list(row)
            runs.append(last)
    return tuple(list(column) for column in zip(*runs, strict=True)) if runs else ([], [], [], [], [])
