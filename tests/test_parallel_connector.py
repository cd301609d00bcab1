"""The parallel seam: a connector may plan each consumer rank's copies and notices; kvspec's planner is the default.

The ``PAR-*`` cases ask :func:`kvspec.connector.as_parallel_connector` of the connector under test; these
tests show that a connector's own wrong mapping fails the case the rule names, that a connector without
the hook is planned by kvspec, and that one that cannot express a case has it skipped with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from kvspec_conformance import run_suite
from kvspec_conformance._report import Outcome

from kvspec import ParallelismError
from kvspec.connector import (
    ConsumerRankPlan,
    ParallelConnector,
    ReferenceConnector,
    ReferenceParallelConnector,
    as_parallel_connector,
)
from kvspec.spec.parallel import CanonicalPage, PageTensor, SubBlock


class _Planned(ReferenceConnector):
    """An exchange connector whose parallel hook is kvspec's, for subclasses to bend one way."""

    def plan_consumer_rank(self, pages: Sequence[CanonicalPage], **kw: int) -> ConsumerRankPlan:
        return ReferenceParallelConnector().plan_consumer_rank(pages, **kw)


class ScalesSubBlocksByTpRatio(_Planned):
    """Plans each tensor's split axis as one block, as vLLM #55208 does with Mamba-2's replicated B and C."""

    def plan_consumer_rank(self, pages: Sequence[CanonicalPage], **kw: int) -> ConsumerRankPlan:
        def merged(t: PageTensor) -> PageTensor:
            return attrs.evolve(
                t, sub_blocks=[SubBlock(name=t.name, extent=sum(b.extent * b.width for b in t.sub_blocks))]
            )

        return super().plan_consumer_rank([CanonicalPage(tensors=[merged(t) for t in p.tensors]) for p in pages], **kw)


class NotifiesNobody(_Planned):
    """Reads right and tells no producer rank: they never free (PAR-6)."""

    def plan_consumer_rank(self, pages: Sequence[CanonicalPage], **kw: int) -> ConsumerRankPlan:
        return attrs.evolve(super().plan_consumer_rank(pages, **kw), notified=(), completion_counts=())


class NoStateSupport(_Planned):
    """Cannot express a state page, and says so."""

    def plan_consumer_rank(self, pages: Sequence[CanonicalPage], **kw: int) -> ConsumerRankPlan:
        if any(not t.token_rows for p in pages for t in p.tensors):
            raise NotImplementedError("no state pages across TP sizes in this connector")
        return super().plan_consumer_rank(pages, **kw)


def _outcome(connector: object, case_id: str) -> tuple[Outcome, str]:
    (result,) = run_suite("loopback", rules=[case_id], connector=connector).results  # type: ignore[arg-type]
    return result.outcome, result.message


def test_a_connector_without_the_hook_is_planned_by_kvspec() -> None:
    assert not isinstance(ReferenceConnector(), ParallelConnector)
    assert isinstance(as_parallel_connector(ReferenceConnector()), ReferenceParallelConnector)
    assert _outcome(ReferenceConnector(), "PAR-3/mamba2-n-groups-1")[0] is Outcome.PASSED


def test_the_connectors_own_mapping_is_what_the_case_judges() -> None:
    outcome, message = _outcome(ScalesSubBlocksByTpRatio(), "PAR-3/mamba2-n-groups-1")
    assert outcome is Outcome.FAILED
    assert "differs from the canonical projection" in message
    assert _outcome(_Planned(), "PAR-3/mamba2-n-groups-1")[0] is Outcome.PASSED  # the same hook, unbent


def test_a_connector_that_notifies_nobody_fails_the_completion_count() -> None:
    outcome, message = _outcome(NotifiesNobody(), "PAR-6/producer-waits-for-every-consumer-rank")
    assert outcome is Outcome.FAILED
    assert "freed the request's blocks after None notifications" in message


def test_what_a_connector_cannot_express_is_skipped_with_its_reason() -> None:
    outcome, message = _outcome(NoStateSupport(), "PAR-3/gdn-tp-1-to-4")
    assert outcome is Outcome.SKIPPED
    assert "no state pages across TP sizes" in message
    assert _outcome(NoStateSupport(), "PAR-1/tp-1-to-2")[0] is Outcome.PASSED


def test_a_plan_names_one_count_per_notified_rank() -> None:
    with pytest.raises(ParallelismError, match="completion_counts: expected one per notified rank"):
        ConsumerRankPlan(copies=[], notified=[0, 1], completion_counts=[1])
