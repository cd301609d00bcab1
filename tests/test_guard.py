"""INT-3: the guard's rule checks on the block lists a connector used, the TP agreement, the modes."""

from __future__ import annotations

import io
import random
from collections.abc import Callable

import pytest
from strategies import config_from_specs

import kvspec
import kvspec.fast
from kvspec import (
    BlockAlignmentError,
    FullAttentionSpec,
    IntegrityMismatchError,
    KVSpecError,
    SlidingWindowSpec,
    TransferRequest,
    WindowCoverageError,
)
from kvspec.cli import main
from kvspec.spec import (
    GuardMode,
    GuardVerdict,
    agree_verdicts,
    apply_guard_mode,
    check_request_blocks,
    get_guard_verdict,
    get_rule_id,
)
from kvspec.spec import check_request_blocks as plain_check
from kvspec.tools import _guard_selftest
from kvspec.tools._guard_selftest import INJECTIONS

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16")
WINDOW = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16", sliding_window=8)
CONFIG = config_from_specs([FULL, WINDOW], num_blocks=64)
# 16 tokens: 4 full blocks; the window (8 tokens, budget cdiv(8, 4) + 1 = 3) keeps its last 3.
PRODUCER = [[1, 2, 3, 4], [5, 6, 7]]
CONSUMER = [[11, 12, 13, 14], [15, 16, 17]]


def test_a_correct_request_passes_and_gives_its_pairs() -> None:
    pairs = check_request_blocks(
        CONFIG,
        TransferRequest(num_tokens=16, prefix_hit_tokens=0, producer_block_ids=PRODUCER, consumer_block_ids=CONSUMER),
    )
    assert [list(g) for g in pairs.consumer_block_ids] == CONSUMER


def test_an_unclipped_window_list_is_caught_by_clip_1() -> None:
    with pytest.raises(BlockAlignmentError, match=r"budget 3.*\(CLIP-1\)") as caught:
        check_request_blocks(
            CONFIG,
            TransferRequest(
                num_tokens=16,
                prefix_hit_tokens=0,
                producer_block_ids=[[1, 2, 3, 4], [5, 6, 7, 8]],
                consumer_block_ids=CONSUMER,
            ),
        )
    assert get_rule_id(caught.value) == "CLIP-1"


def test_a_null_needed_block_is_caught_by_win_1() -> None:
    with pytest.raises(WindowCoverageError) as caught:
        check_request_blocks(
            CONFIG,
            TransferRequest(
                num_tokens=16,
                prefix_hit_tokens=0,
                producer_block_ids=PRODUCER,
                consumer_block_ids=[[11, 12, 0, 14], [15, 16, 17]],
            ),
        )
    assert get_rule_id(caught.value) == "WIN-1"


def _verdict(request_id: str, rule: str = "INT-2") -> GuardVerdict:
    return GuardVerdict(request_id=request_id, rule=rule, page="group 0, tokens [0, 4)", message=f"{request_id} bad")


def test_the_ranks_agree_on_the_union_in_one_order() -> None:
    rank0 = [_verdict("b")]
    rank1 = [_verdict("a", "WIN-1"), _verdict("b", "PAR-3")]
    agreed = agree_verdicts([rank0, rank1])
    assert [v.request_id for v in agreed] == ["b", "a"]
    assert agreed[0].rule == "INT-2"  # the lowest rank's verdict is kept
    assert agree_verdicts([rank0, rank1]) == agreed


def test_the_modes() -> None:
    found = (_verdict("a"), _verdict("b"))
    assert apply_guard_mode("off", found) == ()
    assert apply_guard_mode(GuardMode.LOG, found) == ()
    assert apply_guard_mode("fail", found) == ("a", "b")
    assert apply_guard_mode("raise", ()) == ()
    with pytest.raises(IntegrityMismatchError, match="a bad") as caught:
        apply_guard_mode("raise", found)
    assert (caught.value.rule, caught.value.request_id, caught.value.page) == ("INT-2", "a", "group 0, tokens [0, 4)")


def test_a_verdict_names_the_rule_request_and_page() -> None:
    verdict = get_guard_verdict("r1", WindowCoverageError("group 0 ... (WIN-1)"), page="group 0, tokens [8, 12)")
    assert verdict.rule == "WIN-1"
    assert "'r1'" in verdict.message
    assert "tokens [8, 12)" in verdict.message


def test_selftest_catches_every_injection_and_exits_0() -> None:
    out = io.StringIO()
    assert main(["guard", "selftest", "--seed", "3", "--producer-tp", "4", "--consumer-tp", "2"], out=out) == 0
    lines = out.getvalue().splitlines()
    for case in INJECTIONS:
        (line,) = [x for x in lines if x.split()[1:2] == [case]]
        assert line.startswith("ok"), line
    assert "caught by CLIP-1" in out.getvalue()
    assert out.getvalue().count("caught by INT-2, first differing page group 0, tokens [") == 4


def test_selftest_exits_1_when_a_mismatch_is_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Partial mode digests the ends of each cell: a byte in the middle is missed, as INT-2 states.
    out = io.StringIO()
    assert main(["guard", "selftest", "--mode", "partial", "--offset", "5000"], out=out) == 1
    assert "MISSED flipped_byte" in out.getvalue()
    # A verify path that never compares misses everything but the unclipped list.
    monkeypatch.setattr(_guard_selftest, "check_digests", lambda *a, **k: None)
    out = io.StringIO()
    assert main(["guard", "selftest"], out=out) == 1
    assert "missed: wrong_page, wrong_slot, stale_page, flipped_byte" in out.getvalue()


def _outcome(check: Callable[..., object], **kw: object) -> object:
    try:
        return check(CONFIG, TransferRequest(**kw))  # type: ignore[arg-type]
    except KVSpecError as exc:
        return (type(exc), str(exc))


def test_the_engine_speed_path_is_the_definition() -> None:
    """kvspec.fast.check_request_blocks answers and refuses as its definition does, on random lists (INT-3)."""
    rng = random.Random(34)
    seen = set()
    for _ in range(300):
        tokens = rng.randrange(1, 40)
        hit = 4 * rng.randrange(0, tokens // 4 + 1) if rng.random() < 0.3 else 0
        full, window = -(-tokens // 4), min(-(-tokens // 4), 3)
        producer = [rng.sample(range(1, 64), full), rng.sample(range(1, 64), window + rng.choice([0, 0, 1]))]
        consumer = [rng.sample(range(1, 64), full - hit // 4), rng.sample(range(1, 64), window)]
        for ids in (producer, consumer):
            if rng.random() < 0.2 and ids[0]:
                ids[0][rng.randrange(len(ids[0]))] = 0
            if rng.random() < 0.1:
                ids[rng.randrange(2)].append(rng.randrange(1, 64))
        kw = {"num_tokens": tokens, "prefix_hit_tokens": hit, "producer_block_ids": producer}
        fast = _outcome(kvspec.fast.check_request_blocks, **kw, consumer_block_ids=consumer)
        assert fast == _outcome(plain_check, **kw, consumer_block_ids=consumer), (tokens, hit, producer, consumer)
        seen.add(fast[0] if isinstance(fast, tuple) else "pairs")
    assert {"pairs", BlockAlignmentError, WindowCoverageError} <= seen  # the draws reach answers and refusals
