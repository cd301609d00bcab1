"""Tests of DescriptorList, the packed form of a descriptor list, and of its bounds (PLAN-1)."""

from __future__ import annotations

import itertools
import struct
import sys
from collections.abc import Sequence

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from transport_helpers import desc

from kvspec import ConfigError, PlanError, TransferMode
from kvspec.core._descriptors import merge_columns
from kvspec.protocol._plan import PageCopy, TransferPlan
from kvspec.transport import Descriptor, DescriptorList, check_descriptors, merge_runs

FIELDS = ("local_region", "local_offset", "remote_region", "remote_offset", "nbytes")
INT64 = st.integers(-(2**63), 2**63 - 1)

descriptors = st.builds(
    Descriptor,
    local_region=st.integers(0, 3),
    local_offset=st.integers(0, 1 << 20),
    remote_region=st.integers(0, 3),
    remote_offset=st.integers(0, 1 << 20),
    nbytes=st.integers(1, 1 << 16),
)


@given(st.lists(descriptors, max_size=40))
def test_it_holds_exactly_the_descriptors_it_was_given(items: list[Descriptor]) -> None:
    packed = DescriptorList(items)
    assert len(packed) == len(items)
    assert list(packed) == items
    assert [packed[i] for i in range(-len(items), 0)] == items
    assert packed == items
    assert packed[1:3] == items[1:3]
    assert isinstance(packed[1:3], DescriptorList)
    assert packed.total_bytes == sum(d.nbytes for d in items)
    for name in FIELDS:
        assert list(packed.column(name)) == [getattr(d, name) for d in items]
    assert DescriptorList.from_columns(**{name: list(packed.column(name)) for name in FIELDS}) == packed


@given(st.lists(descriptors, max_size=20))
def test_bytes_are_five_little_endian_int64_columns(items: list[Descriptor]) -> None:
    packed = DescriptorList(items)
    raw = packed.to_bytes()
    assert len(raw) == 5 * 8 * len(items)
    values = struct.unpack(f"<{5 * len(items)}q", raw)
    for column, name in enumerate(FIELDS):
        assert list(values[column * len(items) : (column + 1) * len(items)]) == [getattr(d, name) for d in items]
    view = packed.view()
    assert view.readonly
    if sys.byteorder == "little":
        assert view.tobytes() == raw


def test_repr_is_python_that_rebuilds_it() -> None:
    packed = DescriptorList([desc(0, 4096, 1, 0, 4096), desc(1, 0, 0, 8192, 512)])
    assert eval(repr(packed), {"DescriptorList": DescriptorList, "Descriptor": Descriptor}) == packed


def test_of_passes_a_packed_list_through_and_packs_anything_else() -> None:
    packed = DescriptorList([desc(0, 0, 0, 0, 8)])
    assert DescriptorList.of(packed) is packed
    assert DescriptorList.of([desc(0, 0, 0, 0, 8)]) == packed
    assert DescriptorList(packed) == packed


def test_index_out_of_range_raises_index_error() -> None:
    packed = DescriptorList([desc(0, 0, 0, 0, 8)])
    with pytest.raises(IndexError, match="out of range for 1"):
        packed[1]
    with pytest.raises(IndexError, match=r"DescriptorList index -2 out of range for 1 descriptors"):
        packed[-2]


def test_it_is_not_hashable_since_it_equals_lists() -> None:
    with pytest.raises(TypeError, match=r"unhashable type: 'DescriptorList'"):
        hash(DescriptorList())


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (desc(0, 0.5, 0, 0, 8), "local_offset: expected 64-bit signed ints"),  # type: ignore[arg-type]
        (desc(0, 0, 0, 2**63, 8), "remote_offset: expected 64-bit signed ints"),
        (desc(0, 0, "1", 0, 8), "remote_region: expected 64-bit signed ints"),  # type: ignore[arg-type]
    ],
)
def test_fields_that_are_not_int64_are_config_errors_naming_the_field(bad: Descriptor, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DescriptorList([desc(0, 0, 0, 0, 8), bad])


def test_items_that_are_not_descriptors_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"expected Descriptor items, got \(0, 0, 0, 0, 8\)"):
        DescriptorList([(0, 0, 0, 0, 8)])  # type: ignore[list-item]


def test_columns_of_different_lengths_are_refused_naming_the_column() -> None:
    with pytest.raises(ConfigError, match=r"DescriptorList\.nbytes: expected 2 values .*got 1"):
        DescriptorList.from_columns(
            local_region=[0, 0], local_offset=[0, 8], remote_region=[0, 0], remote_offset=[0, 8], nbytes=[8]
        )
    with pytest.raises(ConfigError, match=r"DescriptorList\.column: expected one of"):
        DescriptorList().column("offset")


# --------------------------------------------------------------------------- bounds (PLAN-1)


def inside(d: Descriptor, local_sizes: list[int], remote_sizes: list[int]) -> bool:
    """The row-by-row PLAN-1 check the bounds stand in for."""
    return (
        d.nbytes > 0
        and 0 <= d.local_region < len(local_sizes)
        and 0 <= d.remote_region < len(remote_sizes)
        and 0 <= d.local_offset <= local_sizes[d.local_region] - d.nbytes
        and 0 <= d.remote_offset <= remote_sizes[d.remote_region] - d.nbytes
    )


small = st.integers(-(2**40), 2**40)
any_descriptors = st.builds(
    Descriptor, local_region=small, local_offset=small, remote_region=small, remote_offset=small, nbytes=small
)


@given(
    items=st.lists(descriptors, max_size=12),
    slack=st.lists(st.integers(-64, 64), min_size=2, max_size=8),
)
def test_bounds_that_fit_prove_every_descriptor_is_inside(items: list[Descriptor], slack: list[int]) -> None:
    # Region sizes a few bytes either side of the furthest end, where an off-by-nbytes bound would show.
    local_end = max((d.local_offset + d.nbytes for d in items), default=0)
    remote_end = max((d.remote_offset + d.nbytes for d in items), default=0)
    half = len(slack) // 2
    local_sizes = [max(1, local_end + s) for s in slack[:half]]
    remote_sizes = [max(1, remote_end + s) for s in slack[half:]]
    bounds = DescriptorList(items).bounds
    if bounds.fits(local_sizes, remote_sizes):
        assert all(inside(d, local_sizes, remote_sizes) for d in items)
    # With regions of one size, the bounds are also complete: a valid list always fits.
    uniform_local, uniform_remote = [min(local_sizes)] * len(local_sizes), [min(remote_sizes)] * len(remote_sizes)
    valid = all(inside(d, uniform_local, uniform_remote) for d in items)
    assert bounds.fits(uniform_local, uniform_remote) == valid


@given(
    items=st.lists(any_descriptors, min_size=1, max_size=4),
    local_sizes=st.lists(st.integers(1, 1 << 41), min_size=1, max_size=3),
    remote_sizes=st.lists(st.integers(1, 1 << 41), min_size=1, max_size=3),
)
def test_bounds_of_arbitrary_values_never_let_a_bad_descriptor_through(
    items: list[Descriptor], local_sizes: list[int], remote_sizes: list[int]
) -> None:
    if DescriptorList(items).bounds.fits(local_sizes, remote_sizes):
        assert all(inside(d, local_sizes, remote_sizes) for d in items)


def test_one_bad_descriptor_among_many_breaks_the_fit() -> None:
    good = [desc(0, i * 8, 0, i * 8, 8) for i in range(100)]
    assert DescriptorList(good).bounds.fits([800], [800])
    for bad in (desc(0, 800, 0, 0, 8), desc(0, 0, 1, 0, 8), desc(0, 0, 0, -8, 8), desc(0, 0, 0, 0, 0)):
        assert not DescriptorList([*good[:50], bad, *good[50:]]).bounds.fits([800], [800]), bad


def test_an_empty_list_fits_anything() -> None:
    assert DescriptorList().bounds.fits([], [])


# --------------------------------------------------------------------------- the planner hands it over


def test_a_plan_hands_backends_a_packed_list() -> None:
    copies = [
        PageCopy(producer_region=0, producer_offset=0, consumer_region=1, consumer_offset=64, nbytes=32),
        PageCopy(producer_region=1, producer_offset=96, consumer_region=0, consumer_offset=0, nbytes=16),
    ]
    plan = TransferPlan(copies=copies, groups=[])
    read = plan.to_descriptors(TransferMode.READ)
    assert isinstance(read, DescriptorList)
    assert read == [desc(1, 64, 0, 0, 32), desc(0, 0, 1, 96, 16)]
    assert plan.to_descriptors(TransferMode.WRITE) == [desc(0, 0, 1, 64, 32), desc(1, 96, 0, 0, 16)]
    assert read.total_bytes == plan.total_bytes


# --------------------------------------------------------------------------- the shared bounds check and run merge

# Pages of 16 bytes in two regions, often adjacent, so that runs form.
adjacent_rows = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(0, 1), st.integers(0, 7), st.integers(1, 2)),
    max_size=40,
).map(lambda rows: [desc(lr, lo * 16, rr, ro * 16, n * 16) for lr, lo, rr, ro, n in rows])


def _expand(runs: Sequence[Descriptor]) -> list[tuple[int, int, int, int]]:
    """Every 16-byte page a list moves, as (local region, local offset, remote region, remote offset)."""
    return [
        (d.local_region, d.local_offset + k, d.remote_region, d.remote_offset + k)
        for d in runs
        for k in range(0, d.nbytes, 16)
    ]


@given(adjacent_rows)
@example([desc(0, 0, 0, 0, 16), desc(0, 16, 0, 16, 16), desc(1, 32, 0, 32, 16)])  # same offsets, another region
@example([desc(0, 0, 0, 0, 16), desc(0, 16, 0, 48, 16)])  # adjacent on one side only
def test_merge_runs_moves_the_same_pages_in_maximal_runs(rows: list[Descriptor]) -> None:
    merged = merge_runs(rows)
    assert _expand(merged) == _expand(rows)
    assert merged.total_bytes == sum(d.nbytes for d in rows)
    for a, b in itertools.pairwise(merged):  # no two neighbours could merge further
        continues = (
            a.local_region == b.local_region
            and a.remote_region == b.remote_region
            and a.local_offset + a.nbytes == b.local_offset
            and a.remote_offset + a.nbytes == b.remote_offset
        )
        assert not continues, (a, b)


def test_merge_runs_would_fail_a_merge_that_ignores_the_region() -> None:
    # The mutant: merging on offsets alone joins rows of different regions.
    rows = [desc(0, 0, 0, 0, 16), desc(1, 16, 0, 16, 16)]
    wrong = [desc(0, 0, 0, 0, 32)]
    assert _expand(merge_runs(rows)) == _expand(rows)
    assert _expand(wrong) != _expand(rows)


@given(adjacent_rows)
def test_the_numpy_merge_is_the_same_function(rows: list[Descriptor]) -> None:
    np = pytest.importorskip("numpy")
    columns = [[getattr(d, name) for d in rows] for name in FIELDS]
    plain = merge_columns(*columns)
    vectorised = merge_columns(*(np.array(column, dtype=np.int64) for column in columns))
    assert [list(c) for c in plain] == [c.tolist() for c in vectorised]


@given(st.lists(descriptors, max_size=20), st.lists(st.integers(1, 1 << 21), min_size=1, max_size=4))
def test_check_descriptors_refuses_exactly_the_rows_outside(items: list[Descriptor], sizes: list[int]) -> None:
    def inside(d: Descriptor) -> bool:
        return all(
            0 <= region < len(sizes) and offset >= 0 and offset + d.nbytes <= sizes[region]
            for region, offset in ((d.local_region, d.local_offset), (d.remote_region, d.remote_offset))
        )

    bad = [i for i, d in enumerate(items) if not inside(d)]
    if bad:
        with pytest.raises(PlanError, match=rf"^descriptor {bad[0]}: "):
            check_descriptors(items, local_sizes=sizes, remote_sizes=sizes)
    else:
        assert check_descriptors(items, local_sizes=sizes, remote_sizes=sizes) == items


def test_check_descriptors_refuses_what_is_not_a_descriptor() -> None:
    with pytest.raises(PlanError, match=r"expected Descriptor items"):
        check_descriptors([(0, 0, 0, 0, 16)], local_sizes=[64], remote_sizes=[64])  # type: ignore[list-item]
