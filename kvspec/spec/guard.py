"""The guard: the rule checks on the block lists a connector used, and what a consumer does on a mismatch, INT-3.

A guard runs inside a serving engine, on every request or a sample (INT-2's
``sampled`` mode). For one request it runs two checks on the consumer:

- :func:`check_request_blocks`, the rule checks on the block lists the
  connector actually used (window coverage WIN-1, clipping CLIP-1, alignment
  ALIGN-1 and NULL-1, state position STATE-1, parallel ownership PAR-3), each
  by calling the definition in :mod:`kvspec.spec` that the rule names;
- the digest check of :mod:`kvspec.spec.digest` (INT-2): what the consumer
  received against what the producer held.

The semantics (INT-3):

1. The consumer verifies **before** the request is reported loaded (before
   the engine schedules it): a request that fails never decodes.
2. A mismatch fails the request with a typed reason,
   :class:`~kvspec.IntegrityMismatchError`, naming the rule, the request and
   the first differing page (:func:`get_guard_verdict`).
3. The TP ranks (and PP stages) of one consumer **agree** before a request is
   dropped: each rank contributes its verdicts, every rank drops the union, in
   the same order (:func:`agree_verdicts`). A rank that dropped alone would run
   a different batch from its peers and hang the collective.
4. The mode (:class:`GuardMode`) says what a verdict does: ``off`` checks
   nothing, ``log`` logs and loads anyway, ``fail`` fails the request,
   ``raise`` (CI) raises, because one failed request is easy to miss in a
   passing run (:func:`apply_guard_mode`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvspec.core._errors import BlockAlignmentError, ConfigError, IntegrityMismatchError, KVSpecError
from kvspec.core._models import KVCacheConfig, StateProfile
from kvspec.spec.coverage import TransferRequest
from kvspec.spec.pairing import BlockPairs, compute_transfer_pairs
from kvspec.spec.parallel import CanonicalPage, RankCopy, check_coverage
from kvspec.spec.state import check_state_position
from kvspec.spec.window import get_blocks_per_sw

__all__ = [
    "GuardMode",
    "GuardVerdict",
    "RankPlan",
    "agree_verdicts",
    "apply_guard_mode",
    "check_rank_plans",
    "check_request_blocks",
    "get_checked_pairs",
    "get_guard_verdict",
    "get_rule_id",
]


class GuardMode(str, enum.Enum):
    """What a guard does with a mismatch (INT-3): nothing checked, log it, fail the request, raise (CI)."""

    OFF = "off"
    LOG = "log"
    FAIL = "fail"
    RAISE = "raise"


@attrs.frozen(kw_only=True)
class RankPlan:
    """The copies one consumer rank used to fill its page of ``page``, for INT-3's ownership check (PAR-3)."""

    page: CanonicalPage
    producer_tp: int
    consumer_tp: int
    consumer_rank: int
    copies: tuple[RankCopy, ...] = attrs.field(converter=tuple)


def check_request_blocks(
    config: KVCacheConfig,
    request: TransferRequest,
    *,
    state_tokens: int | None = None,
    profile: StateProfile | str = StateProfile.RECOMPUTE,
    rank_plans: Iterable[RankPlan] = (),
) -> BlockPairs:
    """Raise the rule's typed error unless the block lists a connector used obey the rules; return the pairs (INT-3).

    ``config`` is the consumer's; the request's lists are the ones the connector moved
    (after its own clipping), as in :func:`kvspec.spec.compute_transfer_pairs`.
    In order, one pass each over the ids:

    - clipping (CLIP-1): a sliding-window group's list holds at most its
      budget :func:`kvspec.spec.get_blocks_per_sw` (a longer list was not
      clipped, and moves blocks the window never reads);
    - state position (STATE-1): :func:`kvspec.spec.check_state_position`
      with ``state_tokens`` (only where the config has state groups);
    - window coverage, alignment, null pairs, state slots (WIN-1, ALIGN-1,
      NULL-1, STATE-3, STATE-4): :func:`kvspec.spec.compute_transfer_pairs`,
      whose pairs are returned;
    - parallel ownership (PAR-3): :func:`kvspec.spec.check_coverage` for each
      of ``rank_plans`` (the copies each consumer rank used).

    Each error's message ends with the rule id (:func:`get_rule_id`).
    """
    producer, consumer = request.producer_block_ids, request.consumer_block_ids
    budgets = get_blocks_per_sw(config)
    for role, ids in (("producer", producer), ("consumer", consumer)):
        for g, (group, budget) in enumerate(zip(ids, budgets, strict=False)):
            # A window group moves only the blocks its window can read: at most its budget (CLIP-1).
            if budget and len(group) > budget:
                raise BlockAlignmentError(
                    f"group {g}: the {role}'s list holds {len(group)} blocks, past the sliding-window budget "
                    f"{budget}; expected the list clipped to its last {budget} (CLIP-1)"
                )
    return get_checked_pairs(config, request, state_tokens=state_tokens, profile=profile, rank_plans=rank_plans)


def get_checked_pairs(
    config: KVCacheConfig,
    request: TransferRequest,
    *,
    state_tokens: int | None = None,
    profile: StateProfile | str = StateProfile.RECOMPUTE,
    rank_plans: Iterable[RankPlan] = (),
    pair: Callable[[KVCacheConfig, TransferRequest], BlockPairs] = compute_transfer_pairs,
) -> BlockPairs:
    """The guard's checks after clipping, in their order; return the pairs (INT-3).

    The state position (STATE-1), then coverage and pairing by ``pair``
    (WIN-1, ALIGN-1, NULL-1, STATE-3, STATE-4: the definition, or
    ``kvspec.fast.compute_transfer_pairs``, which refuses and pairs the same),
    then each consumer rank's tiling (PAR-3).
    """
    check_state_position(
        config,
        state_tokens=state_tokens,
        num_tokens=request.num_tokens,
        recomputed_tokens=request.recomputed_tokens,
        profile=profile,
    )
    pairs = pair(config, request)
    check_rank_plans(rank_plans)
    return pairs


def check_rank_plans(rank_plans: Iterable[RankPlan]) -> None:
    """Raise unless each consumer rank's copies tile what it owns of its page: :func:`check_coverage` (INT-3, PAR-3)."""
    for plan in rank_plans:
        check_coverage(
            plan.page,
            producer_tp=plan.producer_tp,
            consumer_tp=plan.consumer_tp,
            consumer_rank=plan.consumer_rank,
            copies=plan.copies,
        )


_RULE = re.compile(r"\(([A-Z]+-\d+)\)")


def get_rule_id(error: BaseException) -> str:
    """The rule an error names: its ``rule``, else the last ``(RULE-N)`` of its message, else ``"?"`` (INT-3)."""
    rule = getattr(error, "rule", None)
    if isinstance(rule, str) and rule:
        return rule
    found = _RULE.findall(str(error))
    return str(found[-1]) if found else "?"


@attrs.frozen(kw_only=True)
class GuardVerdict:
    """One rank's finding on one request: the rule that caught it, the first differing page, the message (INT-3)."""

    request_id: str
    rule: str
    page: str | None
    message: str

    def error(self) -> IntegrityMismatchError:
        """The typed failure this verdict is (INT-3)."""
        return IntegrityMismatchError(self.message, rule=self.rule, request_id=self.request_id, page=self.page)


def get_guard_verdict(request_id: str, error: KVSpecError, *, page: str | None = None) -> GuardVerdict:
    """The verdict a failed check gives: the rule it names, the request, the first differing page (INT-3).

    An :class:`IntegrityMismatchError` keeps its own page; for a rule check's
    error ``page`` is what the caller knows (or ``None``).
    """
    if isinstance(error, IntegrityMismatchError) and error.page is not None:
        page = error.page
    rule = get_rule_id(error)
    where = "" if page is None else f", first differing page {page}"
    message = f"request {request_id!r}: {rule} mismatch{where}: {error}"
    return GuardVerdict(request_id=request_id, rule=rule, page=page, message=message)


def agree_verdicts(rank_verdicts: Sequence[Iterable[GuardVerdict]]) -> tuple[GuardVerdict, ...]:
    """The verdicts every rank of one consumer acts on: the union over its ranks, the same on each (INT-3).

    ``rank_verdicts[r]`` is what rank ``r`` (a TP rank or PP stage of one
    consumer) found for the requests of one step. A request is dropped when
    **any** rank found a mismatch (a logical OR across ranks: an all-gather, or
    an all-reduce MAX of a per-request flag). Per request the lowest rank's
    first verdict is kept, and requests come in the order of that rank's list,
    then the next rank's: every rank computes the same tuple from the same
    inputs, so all drop the same requests and run the same batch (INT-3).
    """
    agreed: dict[str, GuardVerdict] = {}
    for verdicts in rank_verdicts:
        for verdict in verdicts:
            agreed.setdefault(verdict.request_id, verdict)
    return tuple(agreed.values())


def apply_guard_mode(mode: GuardMode | str, verdicts: Iterable[GuardVerdict]) -> tuple[str, ...]:
    """What a mode does with agreed verdicts: the request ids to fail, or raise in ``raise`` mode (INT-3).

    ``off``: nothing was checked, nothing fails. ``log``: the caller logs each
    verdict and loads the request anyway; none fails. ``fail``: every request
    with a verdict fails with :meth:`GuardVerdict.error` and never decodes.
    ``raise`` (CI): the first verdict's :class:`IntegrityMismatchError` is raised.
    """
    try:
        chosen = GuardMode(mode)
    except ValueError:
        raise ConfigError(f"mode: expected one of {[m.value for m in GuardMode]}, got {mode!r} (INT-3)") from None
    found = tuple(verdicts)
    if chosen is GuardMode.RAISE and found:
        raise found[0].error()
    if chosen is GuardMode.FAIL:
        return tuple(v.request_id for v in found)
    return ()
