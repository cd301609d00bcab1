"""State groups through vLLM 0.33.0's own code: the adapters' clip and pairing, and the audit's state oracle (issue 26).

The adapters must hand a state group to the code vLLM runs for it:
``clip_ssm_state_blocks`` (NIXL, MoRI-IO), the NIXL worker's Mamba branch of
``_apply_prefix_caching``, MoRI-IO's state tail allowance and Mooncake's null
drop. The audit drives FA + Mamba/GDN requests through vLLM's Mamba manager
and judges each state pair by where the states are (STATE-1 .. STATE-4).
Needs vLLM (``kvspec[vllm]``).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from kvspec_conformance.configs import full, gdn, make_config, mamba

from kvspec import BlockAlignmentError, BlockIds, TransferMode, TransferRequest

pytestmark = pytest.mark.vllm

SCRATCH = 2
CONFIG = make_config(full(4), gdn(4, num_speculative_blocks=SCRATCH), num_blocks=64)
# A state list as vLLM's align-mode manager leaves it: earlier states nulled, the state, two scratch slots.
STATE_LIST = [0, 0, 5, 6, 7]


def _clip(name: str, lists: list[list[int]]) -> list[list[int]]:
    from kvspec.integrations.vllm import make_connector

    connector = make_connector(name)
    connector.check_admission(CONFIG, TransferMode.READ)
    return [list(g) for g in connector.clip_block_ids(CONFIG, BlockIds(lists))]


def _pair(name: str, producer: list[list[int]], consumer: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    from kvspec.integrations.vllm import make_connector

    connector = make_connector(name)
    connector.check_admission(CONFIG, TransferMode.READ)
    pairs = connector.pair_block_ids(
        CONFIG,
        TransferRequest(
            num_tokens=11,
            prefix_hit_tokens=0,
            producer_block_ids=BlockIds(producer),
            consumer_block_ids=BlockIds(consumer),
        ),
    )
    return [list(g) for g in pairs.producer_block_ids], [list(g) for g in pairs.consumer_block_ids]


def test_translation_carries_cache_mode_and_scratch_slots(vllm: Any) -> None:
    from kvspec.integrations.vllm import from_vllm_kv_cache_config, to_vllm_kv_cache_config

    config = make_config(full(16), mamba(16, mamba_type="gdn_attn", cache_mode="align", num_speculative_blocks=3))
    theirs = to_vllm_kv_cache_config(config).kv_cache_groups[1].kv_cache_spec
    assert (theirs.mamba_cache_mode, theirs.num_speculative_blocks, theirs.mamba_type.name) == ("align", 3, "GDN_ATTN")
    assert from_vllm_kv_cache_config(to_vllm_kv_cache_config(config)) == config


@pytest.mark.parametrize("name", ["nixl", "nixl-push", "moriio"])
def test_state_clip_is_vllms_clip_ssm_state_blocks(vllm: Any, name: str) -> None:
    # STATE-2: the scratch slots go, the last remaining slot travels; attention lists are untouched.
    assert _clip(name, [[1, 2, 3], STATE_LIST]) == [[1, 2, 3], [5]]


def test_mooncake_clips_no_state_list_and_pairs_the_tail_after_dropping_nulls(vllm: Any) -> None:
    # Mooncake 0.33's exchange clip leaves a state list whole; its sender drops null ids in state groups only and
    # pairs the producer's tail: with scratch slots listed, a scratch slot travels (the findings page's class).
    assert _clip("mooncake", [[1, 2, 3], STATE_LIST]) == [[1, 2, 3], STATE_LIST]
    producer, consumer = _pair("mooncake", [[1, 2, 3], STATE_LIST], [[11, 12, 13], [0, 9]])
    assert (producer[1], consumer[1]) == ([7], [9])


@pytest.mark.parametrize("name", ["nixl", "moriio"])
def test_a_consumer_list_one_slot_longer_is_head_trimmed(vllm: Any, name: str) -> None:
    # STATE-3: the consumer may also list the slot of the token it recomputes; its first slot receives.
    producer, consumer = _pair(name, [[1, 2, 3], [5]], [[11, 12, 13], [15, 16]])
    assert (producer[1], consumer[1]) == ([5], [15])


@pytest.mark.parametrize(("name", "said"), [("nixl", "unpairable SSM state slots"), ("moriio", r"allowed local tail")])
def test_a_consumer_list_two_slots_longer_is_refused_by_vllm(vllm: Any, name: str, said: str) -> None:
    with pytest.raises(BlockAlignmentError, match=said):
        _pair(name, [[1, 2, 3], [5]], [[11, 12, 13], [15, 16, 17]])


# --------------------------------------------------------------------------- the audit's state oracle


def _state_case(kind: str, mode: str, block_size: int, num_tokens: int, lookahead: int, cached: int = 0) -> Any:
    from kvspec.integrations.vllm_audit import AuditCase, GroupShape

    state = GroupShape(block_size=block_size, state=kind, cache_mode=mode, num_speculative_blocks=lookahead)
    return AuditCase(
        index=7,
        groups=(GroupShape(block_size=block_size), state),
        num_tokens=num_tokens,
        cached_prefix_tokens=cached,
        lookahead=lookahead,
    )


def test_mooncake_scratch_slots_travel_and_the_reference_moves_the_state_only(vllm: Any) -> None:
    from kvspec.integrations.vllm_audit import audit_case

    case = _state_case("mamba2", "none", 16, 40, 1)
    _, findings = audit_case(case, "mooncake")
    assert {f.deviation for f in findings} == {"state-scratch-travels"}, findings
    # kvspec's own functions on the same vLLM tables: no deviation.
    _, reference = audit_case(case, "reference")
    assert reference == [], reference


@pytest.mark.parametrize("n", [97, 98])
def test_a_synchronous_load_fills_the_column_the_recomputing_step_runs_in(vllm: Any, n: int) -> None:
    """MoRI-IO READ loads within the recomputing step, after ``preprocess_mamba`` copied column (t - 1) // B forward:
    it must fill the recomputed token's column, which differs from NIXL's at (N - 1) % B == 0 (N = 97)."""
    from kvspec.integrations.vllm_audit import _config, audit_case, check_drive

    case = _state_case("gdn_attn", "align", 16, n, 0)
    moriio, found = audit_case(case, "moriio")
    assert found == [], found
    nixl, found = audit_case(case, "nixl")
    assert found == [], found
    assert not moriio.load_async
    assert nixl.load_async
    assert moriio.pairs is not None
    assert nixl.pairs is not None
    (_, into), (_, nixl_into) = moriio.pairs[1][0], nixl.pairs[1][0]
    column, nixl_column = moriio.consumer_table[1].index(into), nixl.consumer_table[1].index(nixl_into)
    assert (column, nixl_column) == ((n - 1) // 16, (n - 2) // 16)
    # Judged as an asynchronous load, MoRI-IO's slot is wrong exactly where the two columns differ.
    wrong = {f.deviation for f in check_drive(_config(case.groups, 64), attrs.evolve(moriio, load_async=True))}
    assert wrong == ({"state-wrong-slot", "state-not-transferred"} if n == 97 else set())


def test_nixl_moves_the_state_slot_on_a_prefix_hit_with_scratch_slots(vllm: Any) -> None:
    from kvspec.integrations.vllm_audit import audit_case

    drive, findings = audit_case(_state_case("gdn_attn", "align", 16, 161, 2, cached=64), "nixl")
    assert findings == [], findings
    assert drive.prefix_hit_tokens == 64
    assert drive.producer_tokens == drive.first_computed == 160
    assert drive.pairs is not None
    assert len(drive.pairs[1]) == 1
    assert 0 not in drive.pairs[1][0]


def test_the_state_oracle_catches_broken_pairs(vllm: Any) -> None:
    """Mutants of a correct NIXL drive: each wrong state pair, and a state past the resume point, is found."""
    from kvspec.integrations.vllm_audit import _config, audit_case, check_drive

    case = _state_case("mamba2", "align", 16, 97, 1)
    drive, findings = audit_case(case, "nixl")
    assert findings == []
    assert drive.pairs is not None
    config = _config(case.groups, 64)
    (p, c), *_ = drive.pairs[1]
    p_table, c_table = drive.producer_table[1], drive.consumer_table[1]
    scratch = p_table[p_table.index(p) + 1]
    stale = next(b for b in c_table if b not in (0, c))

    def found(**changes: Any) -> set[str]:
        return {f.deviation for f in check_drive(config, attrs.evolve(drive, **changes))}

    # A scratch slot into the slot the consumer resumes from is a wrong state (STATE-3), not extra bytes; beside the
    # state, into another slot, it is extra bytes (STATE-2).
    assert found(pairs=(drive.pairs[0], ((scratch, c),))) == {"state-wrong-slot"}
    assert found(pairs=(drive.pairs[0], ((p, c), (scratch, stale)))) == {"state-scratch-travels"}
    assert found(pairs=(drive.pairs[0], ((p, stale),))) >= {"state-wrong-slot", "state-not-transferred"}
    assert found(pairs=(drive.pairs[0], ((0, c),))) == {"reads-null-block"}
    assert found(pairs=(drive.pairs[0], ())) == {"state-not-transferred"}
    # A state one token short of the resume point, in the same slot: only its position is wrong.
    assert found(producer_tokens=drive.producer_tokens - 1) == {"state-position"}


def test_moriio_admission_follows_the_installed_release(vllm: Any) -> None:
    """MoRI-IO 0.34 admits full + window + state groups in READ and MLA windows in WRITE; 0.33 refuses both."""
    from kvspec_conformance.configs import mla, sw, sw_mla

    from kvspec import UnsupportedHybridError
    from kvspec.integrations._vllm_versions import vllm_release
    from kvspec.integrations.vllm import build_scheduler

    admitted = vllm_release() >= (0, 34)
    hybrid = make_config(full(16), sw(32, 16), gdn(16), num_blocks=64)
    mla_window = make_config(mla(16), sw_mla(32, 16), num_blocks=64)
    for config, mode in ((hybrid, TransferMode.READ), (mla_window, TransferMode.WRITE)):
        if admitted:
            build_scheduler("moriio", config, role="kv_consumer", mode=mode)
        else:
            with pytest.raises(UnsupportedHybridError, match="vLLM moriio refuses this config"):
                build_scheduler("moriio", config, role="kv_consumer", mode=mode)
