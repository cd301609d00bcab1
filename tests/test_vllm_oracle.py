"""The audit's positional oracle can fail: hand-made tables and pairs, no vLLM needed."""

from __future__ import annotations

import attrs
import pytest

from kvspec import (
    BlockAlignmentError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    TransferRequest,
    compute_transfer_pairs,
)
from kvspec.integrations.vllm_audit import DEVIATIONS, _Drive, check_drive, check_kvspec, generate_cases

B = 16
W = 32


def _config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=2, dtype="int8")
    window = SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=2, dtype="int8", sliding_window=W)
    tensors = [KVCacheTensor(size=64 * 64, layers=[n], layer_stride=0, block_stride=64) for n in ("a", "b")]
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=tensors,
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=["b"], kv_cache_spec=window),
        ],
    )


# N = 80 tokens, C computes token 79 first, no prefix hit: full needs blocks 0..4, the window [48, 78] blocks 3..4.
P_TABLE = ((1, 2, 3, 4, 5), (0, 0, 0, 9, 10))
C_TABLE = ((21, 22, 23, 24, 25), (0, 0, 0, 29, 30))
GOOD = _Drive(
    num_tokens=80,
    prefix_hit_tokens=0,
    first_computed=79,
    producer_table=P_TABLE,
    consumer_table=C_TABLE,
    producer_list=((1, 2, 3, 4, 5), (0, 9, 10)),
    consumer_list=((21, 22, 23, 24, 25), (0, 29, 30)),
    pairs=(((1, 21), (2, 22), (3, 23), (4, 24), (5, 25)), ((9, 29), (10, 30))),
)


def _classes(drive: _Drive) -> set[str]:
    return {f.deviation for f in check_drive(_config(), drive)}


def test_correct_pairs_pass() -> None:
    assert check_drive(_config(), GOOD) == []
    assert check_kvspec(_config(), GOOD, []) == []


def test_each_class_is_found() -> None:
    shifted = attrs.evolve(GOOD, pairs=(GOOD.pairs[0], ((9, 30), (0, 29))))  # type: ignore[index]
    assert _classes(shifted) == {"shifted-pair", "reads-null-block"}
    missing = attrs.evolve(GOOD, pairs=(GOOD.pairs[0][:-1], GOOD.pairs[1]))  # type: ignore[index]
    assert _classes(missing) == {"needed-block-not-transferred"}
    nulled = attrs.evolve(GOOD, consumer_table=(C_TABLE[0], (0, 0, 0, 0, 30)), pairs=(GOOD.pairs[0], ((10, 30),)))  # type: ignore[index]
    assert _classes(nulled) == {"needed-block-null-on-consumer"}
    into_null = attrs.evolve(GOOD, pairs=(GOOD.pairs[0], ((0, 0), (9, 29), (10, 30))))  # type: ignore[index]
    assert _classes(into_null) == {"writes-null-block"}
    cached = attrs.evolve(GOOD, prefix_hit_tokens=32)
    assert _classes(cached) == {"writes-cached-prefix"}
    refused = attrs.evolve(GOOD, pairs=None, refusal="ValueError: no")
    assert _classes(refused) == {"refused"}
    assert _classes(attrs.evolve(GOOD, failed_closed="WindowCoverageError: ...")) == set()


def test_attended_blocks_in_the_prefix_hit_are_checked() -> None:
    # Hit of 64 tokens: window block 3 (tokens 48..63) is cached, and token 79 attends it.
    hit = attrs.evolve(GOOD, prefix_hit_tokens=64, pairs=(GOOD.pairs[0][4:], GOOD.pairs[1]))  # type: ignore[index]
    assert _classes(hit) == {"writes-cached-prefix"}  # (9, 29) rewrites a cached block with its own tokens
    poisoned = attrs.evolve(hit, pairs=(hit.pairs[0], ((0, 29), (10, 30))))  # type: ignore[index]
    assert _classes(poisoned) == {"null-into-cached-block", "reads-null-block"}
    assert all(f.in_hit for f in check_drive(_config(), poisoned))
    # The null page into a cached block nobody attends still poisons the cache.
    unread = attrs.evolve(
        hit,
        consumer_table=(C_TABLE[0], (0, 0, 28, 29, 30)),
        pairs=(hit.pairs[0], ((0, 28), (9, 29), (10, 30))),  # type: ignore[index]
    )
    assert _classes(unread) == {"null-into-cached-block", "writes-cached-prefix"}
    nulled = attrs.evolve(hit, consumer_table=(C_TABLE[0], (0, 0, 0, 0, 30)), pairs=(hit.pairs[0], ((10, 30),)))  # type: ignore[index]
    assert _classes(nulled) == {"needed-block-null-on-consumer"}
    assert check_kvspec(_config(), poisoned, check_drive(_config(), poisoned)) == []


def test_kvspec_judges_the_lists_as_the_oracle_does() -> None:
    # The window lists shifted by one block (lookahead slots on C): same length, so a 1.0 peer's
    # tail alignment accepts them; with the ends a 1.1 connector states, kvspec refuses them.
    shifted = attrs.evolve(
        GOOD,
        consumer_table=(C_TABLE[0] + (26,), (0, 0, 0, 29, 30, 31)),
        consumer_list=((21, 22, 23, 24, 25), (29, 30, 31)),
        pairs=(GOOD.pairs[0], ((0, 29), (9, 30), (10, 31))),  # type: ignore[index]
    )
    findings = check_drive(_config(), shifted)
    assert {f.deviation for f in findings} >= {"shifted-pair"}
    assert check_kvspec(_config(), shifted, findings) == []  # kvspec refuses too: no disagreement
    lists = {"producer_block_ids": shifted.producer_list, "consumer_block_ids": shifted.consumer_list}
    compute_transfer_pairs(_config(), TransferRequest(num_tokens=79, prefix_hit_tokens=0, recomputed_tokens=1, **lists))  # type: ignore[arg-type]
    with pytest.raises(BlockAlignmentError, match="ends at logical block"):
        compute_transfer_pairs(
            _config(),
            TransferRequest(
                num_tokens=79,
                prefix_hit_tokens=0,
                recomputed_tokens=1,
                producer_block_ends=(5, 5),
                consumer_block_ends=(5, 6),
                **lists,
            ),
        )


def test_lists_built_for_the_prompt_length_agree() -> None:
    # N = 81 and B = 16: (N - 1) % B == 0, lists built for N hold one block more than cdiv(N - 1, B).
    p_table = ((1, 2, 3, 4, 5, 6), (0, 0, 0, 9, 10, 11))
    c_table = ((21, 22, 23, 24, 25, 26), (0, 0, 0, 29, 30, 31))
    drive = attrs.evolve(
        GOOD,
        num_tokens=81,
        first_computed=80,
        producer_table=p_table,
        consumer_table=c_table,
        producer_list=((1, 2, 3, 4, 5, 6), (9, 10, 11)),
        consumer_list=((21, 22, 23, 24, 25, 26), (29, 30, 31)),
        pairs=(tuple(zip(p_table[0], c_table[0], strict=True)), ((9, 29), (10, 30), (11, 31))),
    )
    assert check_drive(_config(), drive) == []
    assert check_kvspec(_config(), drive, []) == []
    lists = {"producer_block_ids": drive.producer_list, "consumer_block_ids": drive.consumer_list}
    with pytest.raises(BlockAlignmentError, match="lists 6 blocks"):
        compute_transfer_pairs(_config(), TransferRequest(num_tokens=80, prefix_hit_tokens=0, **lists))  # type: ignore[arg-type]


def test_cases_are_reproducible_and_in_range() -> None:
    cases = generate_cases(300, seed=11)
    assert cases == generate_cases(300, seed=11)
    assert cases != generate_cases(300, seed=12)
    for case in cases:
        assert case.groups[0].window == 0
        assert all(16 <= g.block_size <= 64 for g in case.groups)
        assert all(32 <= g.window <= 4096 for g in case.groups[1:])
        assert 1 <= case.num_tokens <= 200_000
        assert case.cached_prefix_tokens % case.groups[0].block_size == 0
    assert any(c.cached_prefix_tokens for c in cases)
    assert any(c.lookahead for c in cases)
    assert all(d.rule for d in DEVIATIONS.values())


def test_shipped_audit_list_names_the_committed_classes() -> None:
    # kvspec vllm-audit --expect-file vllm-audit fails on an unlisted or vanished class: the shipped list
    # must name exactly the classes of the committed audit (seed 11, 200 requests), new ones included.
    import json
    from pathlib import Path

    from kvspec.integrations._vllm_versions import expected_file_stem
    from kvspec.integrations.expectations import load_expected

    # The installed vLLM release's committed audit and list (vllm-audit.json and vllm-audit for 0.33.0).
    audit = expected_file_stem("vllm-audit") + ".json"
    committed = json.loads((Path(__file__).resolve().parent.parent / "docs" / "explanation" / audit).read_text("utf-8"))
    found = {f"{c['connector']}/{c['class']}" for c in committed["classes"] if c["connector"] != "reference"}
    assert "moriio/null-into-cached-block" in found
    assert set(load_expected("vllm-audit")) == found
