"""The direct transport tier and the one-field HS-1 table cover what they claim to cover."""

from __future__ import annotations

import re

import attrs
import pytest
from kvspec_conformance import CAPABILITIES, all_cases, run_suite
from kvspec_conformance.cases.handshake import equal_width_dtype_pairs, field_alone_rows

from kvspec import DType, EngineDescriptor, GroupDescriptor, IncompatiblePeerError, check_compatibility
from kvspec.transport import Capabilities

# Capabilities a direct case reads rather than requires: it tests every backend, the declared ones harder.
READ_BY_CASE = {"immediate_cancel": "SM-2/transport-release-pending"}
# Capabilities whose absence the direct cases require: they register suite memory with both agents.
ABSENCE_REQUIRED = {"remote_pools": "local_pools"}


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(Capabilities)])
def test_every_capability_has_a_direct_case(field: str) -> None:
    direct = [c for c in all_cases() if c.slug.startswith("transport-")]
    if field == "modes":
        # Every direct case runs once per declared mode; the capability names exist for skipping.
        assert {"read", "write"} <= set(CAPABILITIES)
        assert len(direct) >= 8
        return
    assert field in CAPABILITIES, f"Capabilities.{field} cannot be required by a case"
    if field in READ_BY_CASE:
        # The case holds a backend to the stronger claim when it declares it (tests/mutants.py SlowCancel).
        assert READ_BY_CASE[field] in {c.id for c in direct}
        return
    needed = ABSENCE_REQUIRED.get(field, field)
    assert [c.id for c in direct if needed in c.requires], f"no direct case requires {needed}"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("bfloat16", "float16"),
        ("float8_e4m3fn", "int8"),
        ("float8_e5m2", "uint8"),
        ("float8_e4m3fnuz", "float8_e5m2fnuz"),
    ],
)
def test_the_dtype_rows_pair_equal_widths(a: str, b: str) -> None:
    pairs = equal_width_dtype_pairs()
    assert (a, b) in pairs
    assert all(DType.from_name(x).itemsize == DType.from_name(y).itemsize for x, y in pairs)
    # Six one-byte dtypes give 15 pairs, two two-byte ones 1; float32 has no partner.
    assert len(pairs) == 16


def test_every_descriptor_field_has_a_row_differing_alone() -> None:
    rows = field_alone_rows()
    changed: set[str] = set()
    for name, producer, consumer, field in rows:
        diffs = [
            f.name for f in attrs.fields(EngineDescriptor) if getattr(producer, f.name) != getattr(consumer, f.name)
        ]
        assert len(diffs) == 1, (name, diffs)
        changed.add(diffs[0])
        if diffs == ["groups"] and len(producer.groups) == len(consumer.groups) and field != "groups.order":
            group_diffs = {
                g.name
                for p, c in zip(producer.groups, consumer.groups, strict=True)
                for g in attrs.fields(GroupDescriptor)
                if getattr(p, g.name) != getattr(c, g.name)
            }
            assert len(group_diffs) == 1, (name, group_diffs)
            changed |= {f"groups.{g}" for g in group_diffs}
    assert {f.name for f in attrs.fields(EngineDescriptor)} <= changed
    assert {f"groups.{g.name}" for g in attrs.fields(GroupDescriptor)} <= changed


def test_the_reference_check_refuses_exactly_the_rows_that_name_a_field() -> None:
    for _, producer, consumer, field in field_alone_rows():
        if field is None:
            check_compatibility(producer=producer, consumer=consumer)
        else:
            with pytest.raises(IncompatiblePeerError, match=re.escape(field)):
                check_compatibility(producer=producer, consumer=consumer)


def test_loopback_passes_the_direct_tier() -> None:
    report = run_suite("loopback", rules=[c.id for c in all_cases() if c.slug.startswith("transport-")])
    assert report.passed, [(r.case_id, r.message) for r in report.results if r.is_failure]
    assert any(r.outcome.value == "passed" for r in report.results)
