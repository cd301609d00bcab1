"""The audit draws requests whose prefill and decode engines run different speculation (issue 35, item 3).

Deployments choose the decoder's speculative decoding apart from the
prefiller's: MTP depth, multi-module MTP, scratch slots. Two vLLM 0.33
defects show only then, and each must be found by vLLM's own code under the
audit's oracle, while kvspec's reference on the same vLLM tables moves the
state right or refuses (STATE-1) before a byte moves. Needs vLLM
(``kvspec[vllm]``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _case(mode: str, producer: Any, consumer: Any, num_tokens: int = 40) -> Any:
    from kvspec.integrations.vllm_audit import AuditCase, GroupShape

    state = GroupShape(block_size=16, state="gdn_attn", cache_mode=mode, num_speculative_blocks=producer.scratch)
    return AuditCase(
        index=3,
        groups=(GroupShape(block_size=16), state),
        num_tokens=num_tokens,
        cached_prefix_tokens=0,
        lookahead=producer.tokens,
        producer=producer,
        consumer=consumer,
    )


@pytest.mark.parametrize(("mode", "state_slot", "pair"), [("align", 5, (7, 4)), ("none", 4, (6, 4))])
def test_mooncake_pairs_a_scratch_slot_into_the_state_when_only_prefill_speculates(
    vllm: Any, mode: str, state_slot: int, pair: tuple[int, int]
) -> None:
    """MTP with 2 tokens on the prefiller, none on the decoder: Mooncake's tail pairing sends the last scratch slot."""
    from kvspec.integrations.vllm_audit import Speculation, audit_case

    case = _case(mode, Speculation(tokens=2), Speculation())
    _, findings = audit_case(case, "mooncake")
    assert [(f.deviation, f.pair) for f in findings] == [("state-wrong-slot", pair)], findings
    assert f"expected slot {state_slot} (P, state after 39 tokens)" in findings[0].detail
    # The same tables under kvspec's functions: each side clips its own scratch slots (STATE-2), the state moves.
    reference, found = audit_case(case, "reference")
    assert found == [], found
    assert reference.pairs is not None
    assert reference.pairs[1] == ((state_slot, pair[1]),)
    # Equal settings (both MTP 2): the state lands right, only scratch slots travel beside it (harmless).
    equal = _case(mode, Speculation(tokens=2), Speculation(tokens=2))
    assert {f.deviation for f in audit_case(equal, "mooncake")[1]} == {"state-scratch-travels"}


def test_mooncake_fails_the_transfer_when_only_decode_speculates(vllm: Any) -> None:
    from kvspec.integrations.vllm_audit import Speculation, audit_case

    case = _case("align", Speculation(), Speculation(tokens=2))
    drive, findings = audit_case(case, "mooncake")
    assert [f.deviation for f in findings] == ["refused"], findings
    assert "P num blocks less than D" in (drive.refusal or "")
    assert audit_case(case, "reference")[1] == []


@pytest.mark.parametrize(("producer_multi", "absorbed", "resumes"), [(False, 39, 38), (True, 38, 39)])
def test_nixl_resumes_at_its_own_backoff_when_one_side_runs_multi_module_mtp(
    vllm: Any, producer_multi: bool, absorbed: int, resumes: int
) -> None:
    """Multi-module MTP with 3 tokens backs off 2 tokens, none backs off 1 (Mamba): NIXL's decoder ignores the
    producer's ``remote_num_tokens``, so the state has absorbed one token more or less than the decoder resumes at."""
    from kvspec.integrations.vllm_audit import Speculation, audit_case

    multi, plain = Speculation(tokens=3, multi_module=True), Speculation()
    case = _case("align", multi if producer_multi else plain, plain if producer_multi else multi)
    drive, findings = audit_case(case, "nixl")
    assert (drive.producer_tokens, drive.first_computed) == (absorbed, resumes)
    assert [f.deviation for f in findings] == ["state-position"], findings
    # kvspec refuses it by STATE-1 before any byte moves.
    reference, found = audit_case(case, "reference")
    assert found == [], found
    assert (reference.failed_closed or "").startswith("StatePositionError"), reference.failed_closed
    # Multi-module MTP on both sides: both back off 2, the state stands where the decoder resumes.
    both = _case("align", multi, multi)
    assert audit_case(both, "nixl")[1] == []


def test_speculation_cases_differ_between_the_engines() -> None:
    """Every drawn request runs different speculation on the two engines, and the draw reaches both defects' shapes:
    fewer scratch slots on the decoder, and a prefill backoff (multi-module MTP deeper than 2) on one side only."""
    from kvspec.integrations.vllm_audit import Speculation, generate_speculation_cases

    cases = generate_speculation_cases(20, 11, first_index=250)
    assert [c.index for c in cases] == list(range(250, 270))
    assert all(c.producer is not None and c.consumer is not None and c.producer != c.consumer for c in cases)
    assert all(c.side_groups("consumer")[1].num_speculative_blocks == c.consumer.scratch for c in cases)  # type: ignore[union-attr]
    assert any(c.producer.scratch > c.consumer.scratch for c in cases)  # type: ignore[union-attr]

    def backoff(s: Speculation | None) -> int:
        assert s is not None
        return max(1, s.prefill_lookahead - 1)

    assert any(backoff(c.producer) != backoff(c.consumer) for c in cases)
    assert generate_speculation_cases(20, 11, first_index=250) == cases


@pytest.mark.parametrize(("method", "lookahead"), [("ngram", 0), ("suffix", 0), ("mtp", 3), ("eagle", 3)])
def test_lookahead_slots_by_speculative_method(vllm: Any, method: str, lookahead: int) -> None:
    """vLLM's own ``num_lookahead_tokens`` on a stand-in config: n-gram and suffix decoding reserve no lookahead
    slots (so the MoRI-IO shifted-pair report does not list them), EAGLE and MTP one per draft token."""
    import types

    from kvspec.integrations.vllm import import_vllm

    speculative = import_vllm("vllm.config.speculative").SpeculativeConfig
    stand_in = types.SimpleNamespace(
        method=method, num_speculative_tokens=3, draft_model_config=None, custom_method=None
    )
    for name in [n for n in dir(speculative) if n.startswith(("use_", "uses_")) and callable(getattr(speculative, n))]:
        setattr(stand_in, name, types.MethodType(getattr(speculative, name), stand_in))
    if hasattr(speculative, "speculator_config"):
        # vLLM 0.34 reads the lookahead from the method's speculator config, built from the same stand-in.
        configs = import_vllm("vllm.v1.worker.gpu.spec_decode.speculator_config")
        stand_in.speculator_config = configs.get_speculator_config_class(stand_in)(stand_in)
    config = types.SimpleNamespace(speculative_config=stand_in, num_speculative_tokens=3)
    assert import_vllm("vllm.config").VllmConfig.num_lookahead_tokens.fget(config) == lookahead
